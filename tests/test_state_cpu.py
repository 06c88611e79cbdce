"""State files on the NumPy backend: a resumed sequence equals a full prefill for every cache kind (K/V, MLA
latent rows, Gated DeltaNet conv/ssm state); a state of another model, config, adapter set, version or layout, or a
malformed one, is refused with a typed error."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from engine import state
from engine.engine import Engine
from engine.errors import ContextOverflow, GGUFError, InvalidInput
from engine.gguf import read
from tests import conformance as C
from tests import lora_util

FIXTURES = ["qwen3-tiny-f32", "qwen3-tiny-q8_0", "qwen3moe-tiny-q8_0", "qwen35-tiny-f32", "deepseek2-tiny-f32"]
PREFIX = "<|im_start|>system\nYou are a careful assistant. Answer in one short sentence.<|im_end|>\n"
PROMPT = PREFIX + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _load(name: str, **kw) -> Engine:
    return Engine.load(C.fixture_path(name, ".gguf"), backend="cpu", max_seq_len=128, **kw)


@pytest.mark.parametrize("name", FIXTURES)
def test_resumed_logits_equal_a_full_prefill(tmp_path, name):
    e = _load(name)
    path = str(tmp_path / "s.state")
    summary = e.save_state(PREFIX, path)
    ids = e.tokenizer.encode(PROMPT)
    n = summary["n_positions"]
    assert ids[:n] == e.tokenizer.encode(PREFIX) and n < len(ids)
    full = e.logits(ids)[n:]
    sf = state.load(path)
    assert sf.header["layout"] == e.runner.state_layout and sf.token_ids == ids[:n]
    for _ in range(2):  # the second resume finds the K/V rows still resident and copies only recurrent state
        e.runner.reset()
        e.runner.import_state(sf)
        got = e.runner.forward(ids[n:], "all")
        assert float(np.abs(got - full).max()) <= 1e-4
    e.logits(ids[:5])  # an unrelated sequence overwrites the prefix rows ...
    e.runner.reset()
    e.runner.import_state(sf)  # ... so this resume copies everything again
    assert float(np.abs(e.runner.forward(ids[n:], "all") - full).max()) <= 1e-4


def test_engine_results_resume_from_the_prefix(tmp_path):
    path = str(tmp_path / "s.state")
    plain = _load("qwen35-tiny-f32")
    plain.save_state(PREFIX, path)
    e = _load("qwen35-tiny-f32", prefix_state=path)
    cands = [" Paris", " The capital is Paris"]
    want, got = plain.system1(PROMPT, cands), e.system1(PROMPT, cands)
    assert got["timings"]["prefix_tokens_reused"] == len(e.prefix.token_ids) > 0
    assert "prefix_tokens_reused" not in want["timings"]
    for a, b in zip(want["candidates"], got["candidates"], strict=True):
        assert abs(a["score"] - b["score"]) <= 1e-4
    g_want, g_got = plain.generate(PROMPT, max_tokens=6), e.generate(PROMPT, max_tokens=6)
    assert g_got["token_ids"] == g_want["token_ids"] and g_got["usage"] == g_want["usage"]
    assert g_got["timings"]["prefix_tokens_reused"] > 0
    other = e.system1("Hello there", [" friend"])  # does not start with the prefix: a full prefill
    assert other["timings"]["prefix_tokens_reused"] == 0
    assert e.system1(PREFIX, [" x"])["timings"]["prefix_tokens_reused"] == 0  # nothing past the prefix


def _rewrite_header(src: str, dst: str, **changes) -> None:
    with open(src, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, len(state.MAGIC))
    header = json.loads(data[len(state.MAGIC) + 8 : len(state.MAGIC) + 8 + n])
    header.update(changes)
    blob = json.dumps(header).encode()
    assert len(blob) <= n, "the test rewrites headers without growing them"
    blob = blob + b" " * (n - len(blob))
    with open(dst, "wb") as f:
        f.write(data[: len(state.MAGIC)] + struct.pack("<Q", n) + blob + data[len(state.MAGIC) + 8 + n :])


def test_states_of_another_model_config_or_layout_are_refused(tmp_path):
    path = str(tmp_path / "s.state")
    _load("qwen3-tiny-f32").save_state(PREFIX, path)
    with pytest.raises(InvalidInput, match="another model"):
        _load("qwen3-tiny-q8_0", prefix_state=path)
    pairs = lora_util.random_pairs(read(C.fixture_path("qwen3-tiny-f32", ".gguf")), ["attn_q"], 4, seed=1)
    adapter = lora_util.write_adapter(tmp_path / "a.gguf", "qwen3", pairs, 4.0)
    with pytest.raises(InvalidInput, match="other LoRA adapters"):
        _load("qwen3-tiny-f32", prefix_state=path, lora=[(adapter, 1.0)])
    with pytest.raises(ContextOverflow):
        Engine.load(C.fixture_path("qwen3-tiny-f32", ".gguf"), backend="cpu", max_seq_len=8, prefix_state=path)
    forged = str(tmp_path / "layout.state")
    _rewrite_header(path, forged, layout="kv-f16/9")
    with pytest.raises(InvalidInput, match="cache layout") as info:
        _load("qwen3-tiny-f32", prefix_state=forged)
    assert info.value.kind == "invalid_input"


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: b"NOTSTATE\n\n" + d[10:], "bad magic"),
        (lambda d: d[:10] + struct.pack("<Q", 1 << 40) + d[18:], "header length"),
        (lambda d: d[:-100], "does not fit"),
        (lambda d: d[:12], "too short"),
    ],
)
def test_malformed_state_files_are_gguf_errors(tmp_path, damage, match):
    path = str(tmp_path / "s.state")
    _load("qwen3-tiny-f32").save_state(PREFIX, path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    with pytest.raises(GGUFError, match=match) as info:
        state.load(path)
    assert info.value.kind == "gguf"


def test_another_version_is_refused(tmp_path):
    path = str(tmp_path / "s.state")
    _load("qwen3-tiny-f32").save_state(PREFIX, path)
    _rewrite_header(path, path + "2", version=2)
    with pytest.raises(GGUFError, match="version 2"):
        state.load(path + "2")


def test_a_stale_baked_prefix_is_ignored_with_a_log_line(tmp_path, caplog):
    model = tmp_path / "m.gguf"
    shutil.copy(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), model)
    _load("qwen3-tiny-f32").save_state(PREFIX, state.prefix_path(str(model)))  # another model's state
    e = Engine.load(str(model), backend="cpu", max_seq_len=128)
    assert e.prefix is None and "ignoring the prefix state" in caplog.text
    with pytest.raises(ContextOverflow):
        e.save_state("word " * 200, str(tmp_path / "long.state"))
