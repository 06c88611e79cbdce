"""State files on the CUDA backend (dense family: K/V rows): a resumed sequence equals a full CUDA prefill, states
move between the CPU and CUDA backends (one layout), resident rows are reused and forgotten correctly, the decode
graph runs after a resume, and families whose CUDA model exposes no state arrays refuse state files (typed)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import state
from engine.engine import Engine
from engine.errors import UnsupportedArchitecture
from tests import conformance as C
from tests.test_state_cpu import PREFIX, PROMPT

pytestmark = pytest.mark.gpu


def _load(name: str, backend: str, **kw) -> Engine:
    return Engine.load(C.fixture_path(name, ".gguf"), backend=backend, max_seq_len=128, **kw)


@pytest.mark.parametrize("name", ["qwen3-tiny-f32", "qwen3-tiny-q8_0", "qwen3-tiny-q4_k_m", "qwen3moe-tiny-q8_0"])
def test_cuda_resume_equals_a_full_prefill_and_moves_between_backends(tmp_path, name):
    cuda, cpu = _load(name, "cuda"), _load(name, "cpu")
    assert cuda.backend == "cuda" and cuda.runner.state_layout == cpu.runner.state_layout
    ids = cuda.tokenizer.encode(PROMPT)
    made_on = {"cuda": str(tmp_path / "cuda.state"), "cpu": str(tmp_path / "cpu.state")}
    n = cuda.save_state(PREFIX, made_on["cuda"])["n_positions"]
    cpu.save_state(PREFIX, made_on["cpu"])
    full = cuda.logits(ids)[n:]
    tol = 1e-4 if name.endswith("f32") else 5e-3 * max(1.0, float(np.abs(full).max()))
    for origin, path in made_on.items():
        sf = state.load(path)
        assert sf.header["backend"] == origin
        for _ in range(2):  # the second resume of the same file reuses the resident K/V rows
            cuda.runner.reset()
            cuda.runner.import_state(sf)
            got = cuda.runner.forward(ids[n:], "all")
            assert float(np.abs(got - full).max()) <= tol, (origin, name)
        cuda.logits(ids[:3])  # overwrites rows 0..2: the next resume must copy them again
        cuda.runner.reset()
        cuda.runner.import_state(sf)
        assert float(np.abs(cuda.runner.forward(ids[n:], "all") - full).max()) <= tol
    # the CPU backend resumes the CUDA-made state too
    cpu.runner.reset()
    cpu.runner.import_state(state.load(made_on["cuda"]))
    want_cpu = cpu.logits(ids)[n:]
    cpu.runner.reset()
    cpu.runner.import_state(state.load(made_on["cuda"]))
    assert float(np.abs(cpu.runner.forward(ids[n:], "all") - want_cpu).max()) <= tol


def test_cuda_engine_results_resume_from_a_prefix(tmp_path):
    path = str(tmp_path / "s.state")
    plain = _load("qwen3-tiny-f32", "cuda")
    plain.save_state(PREFIX, path)
    e = _load("qwen3-tiny-f32", "cuda", prefix_state=path)
    cands = [" Paris", " The capital is Paris"]
    want, got = plain.system1(PROMPT, cands), e.system1(PROMPT, cands)
    assert got["timings"]["prefix_tokens_reused"] > 0
    for a, b in zip(want["candidates"], got["candidates"], strict=True):
        assert abs(a["score"] - b["score"]) <= 1e-4
    for _ in range(2):  # decode graphs captured after a resume, then replayed after another
        g_want, g_got = plain.generate(PROMPT, max_tokens=6), e.generate(PROMPT, max_tokens=6)
        assert g_got["token_ids"] == g_want["token_ids"] and g_got["timings"]["prefix_tokens_reused"] > 0
    assert e.system1("Hello there", [" friend"])["timings"]["prefix_tokens_reused"] == 0
    assert e.generate(PROMPT, max_tokens=6)["token_ids"] == g_want["token_ids"]  # after an unrelated request


@pytest.mark.parametrize("name", ["qwen35-tiny-f32"])
def test_families_without_cuda_state_arrays_refuse_state_files(tmp_path, name):
    e = _load(name, "cuda")
    if hasattr(e.runner.model, "state_arrays"):  # the family gained CUDA state files: they must round-trip
        path = str(tmp_path / "s.state")
        n = e.save_state(PREFIX, path)["n_positions"]
        ids = e.tokenizer.encode(PROMPT)
        full = e.logits(ids)[n:]
        e.runner.reset()
        e.runner.import_state(state.load(path))
        assert float(np.abs(e.runner.forward(ids[n:], "all") - full).max()) <= 1e-4
        return
    with pytest.raises(UnsupportedArchitecture, match="state files") as info:
        e.save_state(PREFIX, str(tmp_path / "s.state"))
    assert info.value.kind == "unsupported_architecture"
    cpu_state = str(tmp_path / "cpu.state")
    _load(name, "cpu").save_state(PREFIX, cpu_state)
    with pytest.raises(UnsupportedArchitecture, match="state files"):
        _load(name, "cuda", prefix_state=cpu_state)
