"""`python -m engine profile`: the per-launch decode profile (GPU), and its typed refusal on the CPU backend."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.errors import UnsupportedArchitecture
from engine.tools.profile import profile
from tests import conformance as C


def test_profile_needs_the_cuda_backend():
    engine = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cpu")
    with pytest.raises(UnsupportedArchitecture):
        profile(engine, prompt_tokens=4, repeats=1)


@pytest.mark.gpu
def test_profile_times_every_launch_of_a_decode_step():
    engine = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cuda", max_seq_len=128)
    report = profile(engine, prompt_tokens=8, repeats=5, ablate=True)
    rows = report["launches"]
    assert report["launches_per_step"] == len(rows) > 0
    assert all(r["kernel"] != "?" and "." in r["kernel"] and r["us"] > 0 for r in rows)
    assert rows[-1]["kernel"] == "sample.argmax_f32", rows[-1]  # the greedy step as decode_chain's graph runs it
    assert report["step_ms"] > 0 and report["sum_of_launches_ms"] > 0
    assert sum(k["launches"] for k in report["by_kernel"]) == len(rows)
    assert abs(sum(k["share"] for k in report["by_kernel"]) - 1.0) < 1e-2
    ablated = report["in_step"]  # every kernel once, its launches counted as in the table
    assert sorted((k["kernel"], k["launches"]) for k in ablated) == sorted(
        (k["kernel"], k["launches"]) for k in report["by_kernel"]
    )
    # profiling leaves the sequence usable: the next request gives the same answer as on a fresh engine
    fresh = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cuda", max_seq_len=128)
    want = fresh.generate("The capital of France is", max_tokens=4)["token_ids"]
    assert engine.generate("The capital of France is", max_tokens=4)["token_ids"] == want


@pytest.mark.gpu
def test_profile_times_a_batch_forward():
    """--batch: the launches of a 20-token prompt chunk (tensor-core matmuls, prefill attention) and the last row's
    LM head, each timed; the sequence stays usable after."""
    engine = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cuda", max_seq_len=128)
    report = profile(engine, prompt_tokens=8, repeats=5, batch=20)
    names = {r["kernel"] for r in report["launches"]}
    assert report["batch"] == 20 and report["step_ms"] > 0 and all(r["us"] > 0 for r in report["launches"])
    assert any(n.startswith("tc_matvec.tcmv3_") for n in names), names
    assert any(n.startswith("attention.attn_prefill") for n in names), names  # attn_prefill_tc{hd} on sm_80+
    assert abs(report["tokens_per_s"] * report["step_ms"] / 20000.0 - 1.0) < 1e-2  # tokens a second, not steps
    fresh = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cuda", max_seq_len=128)
    want = fresh.generate("The capital of France is", max_tokens=4)["token_ids"]
    assert engine.generate("The capital of France is", max_tokens=4)["token_ids"] == want
