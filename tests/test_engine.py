"""Engine API semantics (docs/design.md §4) on the NumPy backend with a tiny model."""

from __future__ import annotations

import math
import shutil
import threading

import numpy as np
import pytest

from engine import engine as engine_module
from engine.engine import Engine
from engine.errors import ContextOverflow, InvalidInput
from engine.prepare import file_sha256
from engine.sampling import SamplingParams, sample
from tests import conformance as C

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    return Engine.load(C.fixture_path("qwen3-tiny-f32", ".gguf"), backend="cpu", max_seq_len=64)


def test_system1_scores_are_raw_logits_and_teacher_forced_sums(engine):
    cands = [" Paris", " London", " the city of lights"]
    r = engine.system1(PROMPT, cands, temperature=0.7)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    for c in r["candidates"]:
        ids = c["token_ids"]
        assert engine.tokenizer.encode(PROMPT + c["text"]) == prompt_ids + ids
        rows = engine.logits(prompt_ids + ids[:-1])[len(prompt_ids) - 1 :]
        want = sum(float(rows[k, t]) for k, t in enumerate(ids))
        assert math.isclose(c["score"], want, rel_tol=0, abs_tol=1e-4)
    scores = np.array([c["score"] for c in r["candidates"]]) / 0.7
    p = np.exp(scores - scores.max())
    p /= p.sum()
    assert np.allclose([c["probability"] for c in r["candidates"]], p)
    assert math.isclose(r["entropy_bits"], float(-(p * np.log2(p)).sum()), abs_tol=1e-9)
    assert r["best_idx"] == int(np.argmax(p)) and r["best_text"] == cands[r["best_idx"]]
    assert len(cands) > 1 and len(r["candidates"][2]["token_ids"]) > 1  # a multi-token candidate was exercised


def test_system1_ties_go_to_the_last_maximum(engine):
    r = engine.system1(PROMPT, [" Paris", " Paris"])
    assert r["best_idx"] == 1
    assert math.isclose(r["entropy_bits"], 1.0)


def test_system1_of_a_file_that_ends_encodings_with_eos_scores_the_continuations(engine, monkeypatch):
    """tokenizer.ggml.add_eos_token = true: the candidates are told apart from the prompt without it, and scored
    right after the prompt's text, as for a file without the flag."""
    cands = [" Paris", " the city of lights"]
    want = engine.system1(PROMPT, cands)
    monkeypatch.setattr(engine.tokenizer, "add_eos", True)
    assert engine.tokenizer.encode(PROMPT)[-1] == engine.tokenizer.eos_id
    got = engine.system1(PROMPT, cands)
    assert [c["token_ids"] for c in got["candidates"]] == [c["token_ids"] for c in want["candidates"]]
    assert [c["score"] for c in got["candidates"]] == [c["score"] for c in want["candidates"]]


def test_system1_encodes_the_candidates_once_the_prompt_is_under_way(engine, monkeypatch):
    """The prompt is encoded first and its forward started; the candidates are encoded inside the runner's forward
    (its gather ids, a callable), which on the CUDA backend is while the device runs the prompt. A candidate that
    overflows the context or fails to encode cleanly is still refused, and the next request runs as before."""
    calls = []
    encode, forward = engine.tokenizer.encode, engine.runner.model.forward
    monkeypatch.setattr(
        engine.tokenizer, "encode", lambda text, **kw: calls.append(("encode", text)) or encode(text, **kw)
    )
    monkeypatch.setattr(engine.runner.model, "forward", lambda *a: calls.append(("forward", len(a[0]))) or forward(*a))
    want = engine.system1(PROMPT, [" Paris", " the city of lights"])
    n_prompt = len(encode(PROMPT))
    assert calls[:2] == [("encode", PROMPT), ("forward", n_prompt)], calls
    assert ("encode", PROMPT + " Paris") in calls[2:] and ("encode", PROMPT + " the city of lights") in calls[2:]
    t = want["timings"]
    assert t["total_ms"] >= t["prompt_eval_ms"] + t["decode_ms"] and t["tokenize_ms"] > 0
    with pytest.raises(ContextOverflow, match="the prompt plus the longest candidate"):
        engine.system1(PROMPT, [" Paris", " x" * 80])
    with pytest.raises(ContextOverflow, match="the prompt needs"):
        engine.system1(" x" * 80, [" Paris"])
    again = engine.system1(PROMPT, [" Paris", " the city of lights"])
    assert [c["score"] for c in again["candidates"]] == [c["score"] for c in want["candidates"]]


def test_system1_rejects_bad_candidates(engine):
    with pytest.raises(InvalidInput, match="clean continuation"):
        engine.system1("The capital of Fra", ["nce"])  # "Fra" + "nce" re-tokenizes the prompt's last word
    with pytest.raises(InvalidInput, match="adds no tokens"):
        engine.system1(PROMPT, [""])
    for bad in ([], "Paris", [1]):
        with pytest.raises(InvalidInput):
            engine.system1(PROMPT, bad)
    with pytest.raises(InvalidInput, match="temperature"):
        engine.system1(PROMPT, [" Paris"], temperature=0.0)


def test_first_result_has_cold_start_then_none():
    e = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cpu", max_seq_len=64)
    first = e.generate(PROMPT, max_tokens=2)
    cold = first["cold_start"]
    for key in ("imports_ms", "gguf_open_ms", "model_load_ms", "prompt_eval_ms", "process_start_to_ready_ms",
                "process_start_to_first_token_ms"):  # fmt: skip
        assert isinstance(cold[key], float) and cold[key] >= 0, key
    assert cold["process_start_to_first_token_ms"] >= cold["process_start_to_ready_ms"]
    assert e.system1(PROMPT, [" Paris"])["cold_start"] is None
    assert first["backend"] == "cpu" and first["model"]["arch"] == "qwen3"
    assert first["model"]["sha256"] in (None, e.sha256[:16])  # unprepared: hashed beside the first request
    assert e.model_info["sha256"] == e.sha256[:16]


def test_a_result_does_not_wait_for_the_hash_of_an_unprepared_file(tmp_path, monkeypatch):
    """Without a prepare cache the file is hashed on a thread; results go out before it finishes (their sha256 null)
    and what needs the hash (a state's header) waits for it."""
    model = str(tmp_path / "m.gguf")
    shutil.copy(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), model)
    release = threading.Event()

    def slow_hash(path: str) -> str:
        release.wait(30)
        return file_sha256(path)

    monkeypatch.setattr(engine_module, "file_sha256", slow_hash)
    e = Engine.load(model, backend="cpu", max_seq_len=64)
    first = e.system1(PROMPT, [" Paris", " Rome"])
    assert first["model"]["sha256"] is None and first["cold_start"] is not None
    release.set()
    assert e.sha256 == file_sha256(model)
    assert e.system1(PROMPT, [" Paris"])["model"]["sha256"] == e.sha256[:16]


def test_greedy_generate_matches_logits(engine):
    out = engine.generate(PROMPT, max_tokens=6)
    ids = engine.tokenizer.encode(PROMPT)
    for t in out["token_ids"]:
        assert t == int(np.argmax(engine.logits(ids)[-1]))
        ids.append(t)
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": len(out["token_ids"])}
    assert out["finish_reason"] in ("length", "stop")


def test_stream_chunks_concatenate_to_the_result(engine):
    for stop in ([], ["e"], ["the ", "xyz"]):
        s = engine.generate_stream(PROMPT, max_tokens=12, temperature=0.9, seed=3, stop=stop)
        chunks = list(s)
        assert "".join(c["text"] for c in chunks) == s.result["text"]
        assert [t for c in chunks for t in c["token_ids"]] == s.result["token_ids"]
        for st in stop:
            assert st not in s.result["text"]


def test_stop_string_cuts_the_text(engine):
    full = engine.generate(PROMPT, max_tokens=12, temperature=0.8, seed=11)
    text = full["text"]
    if len(text) < 4:
        pytest.skip("the sample is too short to cut")
    stop = text[2:4]
    cut = engine.generate(PROMPT, max_tokens=12, temperature=0.8, seed=11, stop=[stop])
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[: text.find(stop)]


def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate(PROMPT, max_tokens=8, temperature=1.0, top_k=40, top_p=0.9, seed=1234)
    b = engine.generate(PROMPT, max_tokens=8, temperature=1.0, top_k=40, top_p=0.9, seed=1234)
    assert a["token_ids"] == b["token_ids"]


def test_context_overflow_is_rejected_before_running(engine):
    with pytest.raises(ContextOverflow, match="context length exceeded"):
        engine.generate(PROMPT, max_tokens=100)
    with pytest.raises(ContextOverflow):
        engine.logits(list(range(65)))
    with pytest.raises(InvalidInput):
        engine.generate(PROMPT, max_tokens=0)
    with pytest.raises(InvalidInput):
        engine.generate(PROMPT, temperature=-1)
    with pytest.raises(InvalidInput):
        engine.logits([1 << 20])


def test_sampler_filters():
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0], np.float32)
    assert sample(logits, SamplingParams(0.0), 0) == 1  # greedy: lowest id among the maxima
    picks = {sample(logits, SamplingParams(1.0, top_k=2, seed=s), 0) for s in range(200)}
    assert picks == {1, 3}  # ids 1 and 3 tie at the top
    picks = {sample(logits, SamplingParams(1.0, top_k=3, seed=s), 0) for s in range(300)}
    assert picks == {1, 2, 3}
    picks = {sample(logits, SamplingParams(1.0, top_p=0.5, seed=s), 0) for s in range(200)}
    assert picks == {1, 3}
    with pytest.raises(InvalidInput):
        SamplingParams(1.0, top_p=0.0)
