"""KV_CACHE_TYPE=f16 (engine/cache_type.py) on both backends: the setting and its errors, half the cache memory,
every tiny fixture against llama.cpp under docs/design.md §7's rule for the f16 cache, state files in the f16 layouts
moving between the backends, and an f32 state refused by an f16 engine (typed)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import cache_type, state
from engine.engine import Engine
from engine.errors import InvalidInput
from tests import conformance as C
from tests.test_state_cpu import PREFIX, PROMPT

FIXTURES = C.TINY + C.TINY_FAMILIES
F32_FILE_BOUND = 3e-3  # docs/design.md §7, the f16 cache on F32 files (its rounding alone: 1.7e-3 measured)
LAYOUTS = {"qwen3": "kv", "qwen3moe": "kv", "llama": "kv", "qwen35": "hybrid", "deepseek2": "latent"}


def _load(name: str, backend: str = "cpu", kv: str = "f16", **kw) -> Engine:
    return Engine.load(C.fixture_path(name, ".gguf"), backend=backend, max_seq_len=128, kv_cache_type=kv, **kw)


def llamacpp_distance(name: str) -> float:
    """llama.cpp's own max abs distance from exact math over the fixture's prompts (quantized files)."""
    ref, npz, exact = C.load_reference(name)
    return max(float(np.abs(npz[f"prompt{i}_logits"] - exact[f"prompt{i}_logits"]).max())
               for i in range(len(ref["prompts"])))  # fmt: skip


def check_rule(engine: Engine, name: str) -> C.Measured:
    """docs/design.md §7 for an f16 cache: quantized files within 1.25 x llama.cpp's own distance from exact math,
    F32 files within F32_FILE_BOUND; greedy ids identical up to the first small-margin step."""
    m = C.measure(engine, name)
    assert m.prompt_ids_match
    bound = 1.25 * llamacpp_distance(name) if C.is_quantized(name) else F32_FILE_BOUND
    assert m.max_abs_prompt <= bound, (name, m)
    for ours, want, margins in m.greedy:
        assert C.greedy_agrees(ours, want, margins, m.max_abs_prompt), (name, ours, want, margins)
    return m


def test_the_setting_and_its_errors(monkeypatch) -> None:
    assert cache_type.resolve(None, {}) == "f32"
    assert cache_type.resolve(None, {"KV_CACHE_TYPE": " F16 "}) == "f16"
    assert cache_type.resolve("f32", {"KV_CACHE_TYPE": "f16"}) == "f32"  # an argument beats the environment
    with pytest.raises(InvalidInput, match="environment variable KV_CACHE_TYPE='fp8'"):
        cache_type.resolve(None, {"KV_CACHE_TYPE": "fp8"})
    with pytest.raises(InvalidInput, match="kv_cache_type='q8_0'"):
        cache_type.resolve("q8_0")
    monkeypatch.setenv("KV_CACHE_TYPE", "bf16")
    with pytest.raises(InvalidInput, match="KV_CACHE_TYPE") as info:  # before anything is loaded
        Engine.load(C.fixture_path("qwen3-tiny-f32", ".gguf"), backend="cpu")
    assert info.value.kind == "invalid_input"
    monkeypatch.setenv("KV_CACHE_TYPE", "f16")
    e = Engine.load(C.fixture_path("qwen3-tiny-f32", ".gguf"), backend="cpu", max_seq_len=64)
    assert e.model_info["kv_cache_type"] == "f16" and e.runner.cache.k.dtype == np.float16


@pytest.mark.parametrize("name", FIXTURES)
def test_cpu_f16_cache_keeps_the_rule(name: str) -> None:
    e = _load(name)
    arch = e.config.arch
    assert e.runner.state_layout == f"{LAYOUTS[arch]}-f16/1", arch
    check_rule(e, name)


def test_cpu_f16_state_resumes_and_f32_states_are_refused(tmp_path) -> None:
    e = _load("qwen35-tiny-f32")
    path = str(tmp_path / "s.state")
    n = e.save_state(PREFIX, path)["n_positions"]
    sf = state.load(path)
    assert sf.header["layout"] == "hybrid-f16/1" and sf.arrays["k"].dtype == "f2" and sf.arrays["ssm"].dtype == "f4"
    ids = e.tokenizer.encode(PROMPT)
    full = e.logits(ids)[n:]
    e.runner.reset()
    e.runner.import_state(sf)
    assert float(np.abs(e.runner.forward(ids[n:], "all") - full).max()) <= 1e-4  # the same f16 rows, copied
    f32_path = str(tmp_path / "f32.state")
    _load("qwen35-tiny-f32", kv="f32").save_state(PREFIX, f32_path)
    with pytest.raises(InvalidInput, match="cache layout"):
        _load("qwen35-tiny-f32", prefix_state=f32_path)


# -- CUDA ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", FIXTURES)
def test_cuda_f16_cache_keeps_the_rule_and_halves_the_cache(name: str) -> None:
    e = _load(name, "cuda")
    assert e.backend == "cuda" and all(c.dtype == "f2" for c in e.runner.model.caches)
    f32 = _load(name, "cuda", kv="f32")
    kv_mib = {"f16": e.cold_start["kv_cache_mib"], "f32": f32.cold_start["kv_cache_mib"]}
    if name.startswith("qwen35"):  # the recurrent state stays f32
        assert kv_mib["f16"] < kv_mib["f32"], kv_mib
    else:
        assert kv_mib["f16"] == pytest.approx(kv_mib["f32"] / 2), kv_mib
    check_rule(e, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-tiny-q8_0", "qwen35-tiny-f32", "deepseek2-tiny-q8_0"])
def test_f16_states_move_between_the_backends(tmp_path, name: str) -> None:
    cuda, cpu = _load(name, "cuda"), _load(name, "cpu")
    assert cuda.runner.state_layout == cpu.runner.state_layout
    ids = cuda.tokenizer.encode(PROMPT)
    paths = {b: str(tmp_path / f"{b}.state") for b in ("cuda", "cpu")}
    n = cuda.save_state(PREFIX, paths["cuda"])["n_positions"]
    cpu.save_state(PREFIX, paths["cpu"])
    full = cuda.logits(ids)[n:]
    # the backends' K/V differ by float32 rounding, which can tip an f16 rounding: one f16 step at most per value
    tol = F32_FILE_BOUND * max(1.0, float(np.abs(full).max()))
    for origin, path in paths.items():
        cuda.runner.reset()
        cuda.runner.import_state(state.load(path))
        assert float(np.abs(cuda.runner.forward(ids[n:], "all") - full).max()) <= tol, origin
    cpu.runner.reset()
    cpu.runner.import_state(state.load(paths["cuda"]))
    assert float(np.abs(cpu.runner.forward(ids[n:], "all") - full).max()) <= tol
