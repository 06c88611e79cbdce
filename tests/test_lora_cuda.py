"""LoRA on the CUDA backend against the NumPy backend on the same base and adapter: batched (GEMM), 8-token matvec
passes and single-token decode rows, F32 and quantized bases, F32/F16 adapters of ranks that are and are not
multiples of 32, several adapters at once, and llama.cpp's logits on the F32 fixture. The refusal of updates the
CUDA model does not apply needs no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import Engine
from engine.errors import UnsupportedArchitecture
from engine.gguf import read
from tests import conformance as C
from tests import lora_util
from tests.test_lora_fixture import FIXTURES, load_fixture, make_adapters

PROMPT_IDS = [998, 12, 400, 77, 531, 9, 250, 868, 33, 101, 640, 2, 45, 700, 18, 3, 500, 91, 222, 17] * 3


def _pair(base: str, tmp_path, rank: int, seed: int, dtype=np.float32) -> str:
    gf = read(base)
    pairs = lora_util.random_pairs(gf, lora_util.TARGETS["qwen3"], rank, seed)
    if dtype is not np.float32:
        pairs = {k: (a.astype(dtype), b.astype(dtype)) for k, (a, b) in pairs.items()}
    return lora_util.write_adapter(tmp_path / f"a{rank}-{seed}.gguf", "qwen3", pairs, 2.0 * rank, dtype=dtype)


def _rows(engine: Engine, ids: list[int], prefill: int) -> np.ndarray:
    return engine.logits(ids, prefill=prefill)


@pytest.mark.gpu
@pytest.mark.parametrize("base_name", ["qwen3-tiny-f32", "qwen3-tiny-q8_0", "qwen3-tiny-q4_k_m"])
@pytest.mark.parametrize("rank, dtype", [(8, np.float32), (40, np.float16)])
def test_cuda_lora_matches_the_cpu_backend(tmp_path, base_name, rank, dtype):
    base = C.fixture_path(base_name, ".gguf")
    seed = int(np.random.default_rng().integers(2**31))
    adapters = [(_pair(base, tmp_path, rank, seed, dtype), 0.7), (_pair(base, tmp_path, 4, seed + 1), -0.5)]
    cpu = Engine.load(base, backend="cpu", max_seq_len=128, lora=adapters)
    cuda = Engine.load(base, backend="cuda", max_seq_len=128, lora=adapters)
    plain = Engine.load(base, backend="cuda", max_seq_len=128)
    assert cuda.backend == "cuda" and cuda.model_info["lora"] == cpu.model_info["lora"]
    for prefill in (len(PROMPT_IDS), 7, 1):  # GEMM chunk, matvec passes, decode steps
        want, got = _rows(cpu, PROMPT_IDS, prefill), _rows(cuda, PROMPT_IDS, prefill)
        # F32 weights and every matvec: float32 rounding only; quantized weights in the GEMM go through TF32.
        tol = 1e-4 if base_name.endswith("f32") or prefill <= 48 else 5e-3
        err = float(np.abs(got - want).max())
        assert err <= tol * max(1.0, float(np.abs(want).max())), (base_name, rank, prefill, err, seed)
        assert float(np.abs(_rows(plain, PROMPT_IDS, prefill) - want).max()) > 1e-2  # the adapters are applied
    # system1's gathered head and generate's device sampler over the adapted model
    cands = [" Paris", " the city of lights"]
    s_cpu, s_cuda = cpu.system1("The capital of France is", cands), cuda.system1("The capital of France is", cands)
    for a, b in zip(s_cpu["candidates"], s_cuda["candidates"], strict=True):
        assert abs(a["score"] - b["score"]) <= 1e-3
    row = cpu.logits(cpu.tokenizer.encode("Once upon"))[-1]
    top2 = np.sort(row)[-2:]
    if top2[1] - top2[0] > 1e-3:  # the device sampler's first greedy token, unless the top two are a near tie
        assert cuda.generate("Once upon", max_tokens=1)["token_ids"] == [int(np.argmax(row))]


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", sorted(f for f in FIXTURES if f.startswith("qwen3-")))
def test_cuda_lora_matches_llama_cpp(tmp_path, fixture):
    ref, npz, _ = load_fixture(fixture)
    engine = Engine.load(C.fixture_path(ref["base"], ".gguf"), backend="cuda", max_seq_len=128,
                         lora=make_adapters(fixture, tmp_path))  # fmt: skip
    assert engine.backend == "cuda"
    cols = npz["columns"]
    for i, p in enumerate(ref["prompts"]):
        got = engine.logits(p["token_ids"])[:, cols]
        assert float(np.abs(got - npz[f"prompt{i}_logits"]).max()) <= 1e-4


def test_updates_without_a_cuda_path_are_refused_before_the_upload(tmp_path):
    from engine.config import ModelConfig
    from engine.cuda import lora as cuda_lora
    from engine.lora import open_adapters

    moe = C.fixture_path("qwen3moe-tiny-f32", ".gguf")
    gf = read(moe)
    pairs = lora_util.random_pairs(gf, ["ffn_gate_exps"], 4, seed=2)
    path = lora_util.write_adapter(tmp_path / "exps.gguf", "qwen3moe", pairs, 4.0)
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    with pytest.raises(UnsupportedArchitecture, match="no CUDA path") as info:
        cuda_lora.check_supported(cfg, open_adapters([(path, 1.0)], gf))
    assert info.value.kind == "unsupported_architecture"
    hybrid = C.fixture_path("qwen35-tiny-f32", ".gguf")
    gf = read(hybrid)
    path = lora_util.write_adapter(tmp_path / "h.gguf", "qwen35", lora_util.random_pairs(gf, ["ssm_out"], 4, 3), 4.0)
    with pytest.raises(UnsupportedArchitecture, match="no CUDA path"):
        cuda_lora.check_supported(ModelConfig.from_gguf(gf.metadata, gf.tensors), open_adapters([(path, 1.0)], gf))
