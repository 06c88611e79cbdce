"""State files on the CUDA backend, every family (dense K/V rows, MLA latent rows, the hybrids' K/V rows plus conv
and recurrent state): a resumed sequence equals a full CUDA prefill, states move between the CPU and CUDA backends
(one layout per family, the same arrays within float32 rounding), resident rows are reused and forgotten correctly,
the decode graph runs after a resume, the build-time prefix is resumed, and a hybrid whose recurrent state cannot be
transposed by the kernels refuses state files (typed)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import state
from engine.config import ModelConfig
from engine.cuda.context import ContextStarter
from engine.engine import Engine
from engine.errors import UnsupportedArchitecture
from engine.gguf import read
from tests import conformance as C
from tests import synthetic
from tests.test_cuda_hybrid_model import MIXER_INPUTS, MOE_KV, random_tensors
from tests.test_state_cpu import PREFIX, PROMPT

pytestmark = pytest.mark.gpu


def _load(name: str, backend: str, **kw) -> Engine:
    return Engine.load(C.fixture_path(name, ".gguf"), backend=backend, max_seq_len=128, **kw)


RESUMED = ["qwen3-tiny-f32", "qwen3-tiny-q8_0", "qwen3-tiny-q4_k_m", "qwen3moe-tiny-q8_0", "qwen35-tiny-f32",
           "qwen35-tiny-q8_0", "deepseek2-tiny-f32", "deepseek2-tiny-q8_0"]  # fmt: skip


@pytest.mark.parametrize("name", RESUMED)
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


@pytest.mark.parametrize("name", ["qwen3-tiny-f32", "qwen35-tiny-f32", "deepseek2-tiny-f32"])
def test_cuda_engine_results_resume_from_a_prefix(tmp_path, name):
    path = str(tmp_path / "s.state")
    plain = _load(name, "cuda")
    plain.save_state(PREFIX, path)
    e = _load(name, "cuda", prefix_state=path)
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


@pytest.mark.parametrize("name", ["qwen3-tiny-f32", "qwen35-tiny-f32", "deepseek2-tiny-f32"])
def test_cuda_and_cpu_state_files_hold_the_same_arrays(tmp_path, name):
    """The file a CUDA runner writes is the NumPy backend's, array for array (the hybrids' recurrent state comes out
    of the kernels' transposed order), and reading it back leaves the device state as it was."""
    cuda, cpu = _load(name, "cuda"), _load(name, "cpu")
    paths = [str(tmp_path / "cuda.state"), str(tmp_path / "cpu.state")]
    cuda.save_state(PREFIX, paths[0])
    cpu.save_state(PREFIX, paths[1])
    files = [state.load(p) for p in paths]
    assert files[0].header["layout"] == files[1].header["layout"] and files[0].arrays.keys() == files[1].arrays.keys()

    def values(sf, name):
        info = sf.arrays[name]
        return np.frombuffer(sf.mm, np.float32, info.nbytes // 4, info.offset).reshape(info.shape)

    for key in files[0].arrays:
        a, b = values(files[0], key), values(files[1], key)
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-4 * max(1.0, float(np.abs(b).max())), key
        assert float(np.abs(b).max()) > 0.0, key  # a zero array would not tell a transposition from its absence
    cuda.runner.reset()
    cuda.runner.import_state(files[1])
    again = str(tmp_path / "again.state")
    state.save(again, files[1].header, cuda.runner.export_state())  # out, in and out again: the same values
    for key in files[0].arrays:
        assert float(np.abs(values(state.load(again), key) - values(files[1], key)).max()) <= 1e-6, key


def _state_header(runner, ids: list[int]) -> dict:
    return {"layout": runner.state_layout, "backend": runner.backend, "n_positions": len(ids), "token_ids": ids}


@pytest.mark.parametrize("variant", sorted(MIXER_INPUTS))
def test_synthetic_moe_hybrid_states_move_between_backends(tmp_path, variant):
    """qwen35moe / qwen3next files (MoE FFN, grouped V heads, fused ssm_in / ssm_ba; H_k != H_v): a state made on
    either backend resumes on the other, equal to a full prefill."""
    from engine.cuda import load_runner

    arch = variant.split("-")[0]
    kv = dict(MOE_KV) | ({"rope.dimension_sections": [2, 2, 0, 0]} if arch == "qwen35moe" else {})
    cfg = ModelConfig.from_gguf({"general.architecture": arch} | {f"{arch}.{k}": v for k, v in kv.items()})
    path = synthetic.write(tmp_path / f"{variant}.gguf", arch, kv, random_tensors(cfg, MIXER_INPUTS[variant],
                                                                                 synthetic.Weights(41)))  # fmt: skip
    cpu = synthetic.runner(path, max_seq=128)
    gf = read(path)
    gpu, _ = load_runner(ModelConfig.from_gguf(gf.metadata, gf.tensors), gf, 128, ContextStarter(0))
    assert gpu.state_layout == cpu.state_layout == "hybrid-f32/1"
    ids = np.random.default_rng(7).integers(0, 64, size=40).tolist()
    n = 25
    want = synthetic.logits(cpu, ids, len(ids))[n:]
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    for made, resumed in ((gpu, cpu), (cpu, gpu), (gpu, gpu)):  # a CUDA export first, from a fresh runner
        made.reset()
        made.forward(ids[:n], "none")
        file = str(tmp_path / f"{made.backend}-{resumed.backend}.state")
        state.save(file, _state_header(made, ids[:n]), made.export_state())
        sf = state.load(file)
        state.check_layout(sf, resumed.state_layout, resumed.state_spec(n))
        resumed.reset()
        resumed.forward(ids[n:], "none")  # another sequence, snapshot taken: device state and its copy are stale
        resumed.snapshot()
        resumed.reset()
        resumed.import_state(sf)
        got = resumed.forward(ids[n:], "all")
        assert float(np.abs(got - want).max()) <= tol, (variant, made.backend, resumed.backend)


def test_a_hybrid_whose_value_heads_the_gemm_cannot_transpose_refuses_state_files(tmp_path):
    from engine.cuda import load_runner

    kv = dict(MOE_KV) | {"ssm.inner_size": 64}  # 4 v heads of 16: the F32 GEMM needs multiples of 32
    cfg = ModelConfig.from_gguf({"general.architecture": "qwen3next"} | {f"qwen3next.{k}": v for k, v in kv.items()})
    path = synthetic.write(tmp_path / "dv16.gguf", "qwen3next", kv,
                           random_tensors(cfg, MIXER_INPUTS["qwen3next"], synthetic.Weights(3)))  # fmt: skip
    gf = read(path)
    gpu, _ = load_runner(ModelConfig.from_gguf(gf.metadata, gf.tensors), gf, 64, ContextStarter(0))
    with pytest.raises(UnsupportedArchitecture, match="state files") as info:
        gpu.state_spec(4)
    assert info.value.kind == "unsupported_architecture"


@pytest.mark.parametrize("name", ["qwen35-tiny-q8_0", "deepseek2-tiny-q8_0"])
@pytest.mark.parametrize("baked_on", ["cpu", "cuda"])
def test_a_prefix_baked_beside_the_model_is_resumed_on_cuda(tmp_path, name, baked_on):
    """`prepare MODEL --prefix TEXT` (what cmd_prepare runs, in this process), on a build machine without a GPU or
    with one; every later CUDA load resumes the baked state."""
    import shutil

    from engine.prepare import write_cache

    model = str(tmp_path / "model.gguf")
    shutil.copy(C.fixture_path(name, ".gguf"), model)
    write_cache(model)
    baked = Engine.load(model, backend=baked_on, max_seq_len=128).save_state(PREFIX, state.prefix_path(model))
    e = Engine.load(model, backend="cuda", max_seq_len=128)
    assert e.backend == "cuda" and e.prefix is not None
    plain = _load(name, "cuda")
    cands = [" Paris", " The capital is Paris"]
    want, got = plain.system1(PROMPT, cands), e.system1(PROMPT, cands)
    assert got["timings"]["prefix_tokens_reused"] == baked["n_positions"] > 0
    scale = max(1.0, max(abs(c["score"]) for c in want["candidates"]))
    for a, b in zip(want["candidates"], got["candidates"], strict=True):
        assert abs(a["score"] - b["score"]) <= 5e-3 * scale
