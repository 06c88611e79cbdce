"""LoRA on the CUDA backend against the NumPy backend on the same base and adapter: batched (GEMM), 8-token matvec
passes and single-token decode rows, F32 and quantized bases, F32/F16 adapters of ranks that are and are not
multiples of 32, several adapters at once, the dense, hybrid (Gated DeltaNet projections, gated attention, fused
qwen3next inputs), MLA and MoE families (router, expert stacks through the decode kernels and the grouped GEMM,
shared expert), and llama.cpp's logits on the F32 fixtures. LORA_SEED=<seed> replays a failure. The refusal of
updates the CUDA models do not apply (the LM head) needs no GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.cuda.context import ContextStarter
from engine.cuda.dispatch import use_matvec
from engine.engine import Engine
from engine.errors import InvalidInput, UnsupportedArchitecture
from engine.gguf import read
from engine.lora import open_adapters
from tests import conformance as C
from tests import lora_util, synthetic
from tests.test_lora_fixture import FIXTURES, load_fixture, make_adapters

# 80 tokens: past dispatch.MATVEC_MAX, so the whole prompt is a GEMM chunk
PROMPT_IDS = [998, 12, 400, 77, 531, 9, 250, 868, 33, 101, 640, 2, 45, 700, 18, 3, 500, 91, 222, 17] * 4

# A router's top-k gap (in logits) under which the quantized bases' TF32 prefill GEMM may pick either expert of the
# near-tie: then the logits can differ by far more than the GEMM's own error, and the comparison says nothing about the
# adapters. Measured on deepseek2-tiny-q8_0 (2026-12-01): a seed that failed (error 0.10) had a gap of 8.1e-5; seven
# that passed, 1.2e-3 to 9.7e-3. On qwen3moe-tiny-q8_0 (2026-12-03, H200) seed 271636678 failed (error 0.76) with a
# gap of 1.12e-3: the router's input has been through the TF32 GEMMs of every layer before, so its logits move by
# more than one GEMM's rounding. The 3-token and decode comparisons, at 1e-4, run whatever the gap.
ROUTING_TIE = 2e-3


def _min_router_gap(run):
    """(run()'s result, the smallest gap between the k-th and (k+1)-th router logits of a token in the CPU routing
    calls it made; 0 where a bias or expert groups make the logits' order not the choice's, inf without MoE)."""
    from engine.models import moe

    gaps: list[float] = []
    route = moe.route

    def recording(logits, cfg, bias=None):
        if bias is not None or cfg.n_groups > 1:
            gaps.append(0.0)
        else:
            top = -np.sort(-logits, axis=-1)
            gaps.append(float((top[:, cfg.n_experts_used - 1] - top[:, cfg.n_experts_used]).min()))
        return route(logits, cfg, bias)

    moe.route = recording
    try:
        return run(), min(gaps, default=float("inf"))
    finally:
        moe.route = route


def _checked_prefill(cpu, cuda, base_name: str, prefill: int) -> tuple[float, float, float] | None:
    """(error, scale, tolerance) of the CUDA rows against the CPU ones, or None where a quantized base's prefill GEMM
    meets a routing near-tie (ROUTING_TIE)."""
    gemm = not base_name.endswith("f32") and not use_matvec(prefill)
    want, gap = _min_router_gap(lambda: _rows(cpu, PROMPT_IDS, prefill))
    if gemm and gap < ROUTING_TIE:
        print(f"{base_name} prefill {prefill}: a router near-tie ({gap:.2g}), the TF32 GEMM comparison skipped")
        return None
    got = _rows(cuda, PROMPT_IDS, prefill)
    return float(np.abs(got - want).max()), max(1.0, float(np.abs(want).max())), 5e-3 if gemm else 1e-4


def _seed() -> int:
    """A fresh adapter seed, or LORA_SEED=<seed> (from a failure's message) to replay one."""
    return int(os.environ.get("LORA_SEED") or np.random.default_rng().integers(2**31))


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
    seed = _seed()
    adapters = [(_pair(base, tmp_path, rank, seed, dtype), 0.7), (_pair(base, tmp_path, 4, seed + 1), -0.5)]
    cpu = Engine.load(base, backend="cpu", max_seq_len=128, lora=adapters)
    cuda = Engine.load(base, backend="cuda", max_seq_len=128, lora=adapters)
    plain = Engine.load(base, backend="cuda", max_seq_len=128)
    assert cuda.backend == "cuda" and cuda.model_info["lora"] == cpu.model_info["lora"]
    for prefill in (len(PROMPT_IDS), 20, 7, 1):  # GEMM chunk, tc_matvec, matvec passes, decode steps
        want, got = _rows(cpu, PROMPT_IDS, prefill), _rows(cuda, PROMPT_IDS, prefill)
        # F32 weights and every small batch: float32 rounding only; quantized weights in the GEMM go through TF32.
        tol = 1e-4 if base_name.endswith("f32") or use_matvec(prefill) else 5e-3
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


# Every matrix of the hybrid and MLA families' CUDA models that takes an update (their LORA_TARGETS), more than the
# llama.cpp fixtures adapt: the full-attention layers' q/k/v and ffn_up too.
FAMILY_TARGETS = {
    "qwen35": ["attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha",
               "ssm_out", "ffn_gate", "ffn_up", "ffn_down"],
    "deepseek2": ["attn_q", "attn_kv_a_mqa", "attn_output", "ffn_gate", "ffn_up", "ffn_down"],
}  # fmt: skip


def _max_err(cpu, cuda, ids: list[int], prefill: int) -> tuple[float, float]:
    want, got = _rows(cpu, ids, prefill), _rows(cuda, ids, prefill)
    return float(np.abs(got - want).max()), max(1.0, float(np.abs(want).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("base_name", ["qwen35-tiny-f32", "qwen35-tiny-q8_0", "deepseek2-tiny-f32",
                                       "deepseek2-tiny-q8_0"])  # fmt: skip
def test_cuda_lora_of_the_hybrid_and_mla_families_matches_the_cpu_backend(tmp_path, base_name, monkeypatch):
    # Float 1-token matvecs, as the CPU backend computes (1e-4 below): their 16-bit forms (dispatch.matvec_i16) round
    # x, and the model tests hold those to docs/design.md's quantized-file tolerance against llama.cpp's fixtures.
    monkeypatch.setenv("REFLEX_MATVEC_I16", "0")
    base = C.fixture_path(base_name, ".gguf")
    gf = read(base)
    arch = gf.architecture
    seed = _seed()
    adapters = []
    for rank, dtype, scale in ((8, np.float32, 0.7), (40, np.float16, -0.5)):
        pairs = lora_util.random_pairs(gf, FAMILY_TARGETS[arch], rank, seed + rank)
        pairs = {k: (a.astype(dtype), b.astype(dtype)) for k, (a, b) in pairs.items()}
        path = lora_util.write_adapter(tmp_path / f"a{rank}.gguf", arch, pairs, 2.0 * rank, dtype=dtype)
        adapters.append((path, scale))
    shorts = {t.short for a in open_adapters(adapters, gf) for t in a.tensors.values()}
    assert shorts == set(FAMILY_TARGETS[arch])  # every listed matrix exists in the file and is adapted
    cpu = Engine.load(base, backend="cpu", max_seq_len=128, lora=adapters)
    cuda = Engine.load(base, backend="cuda", max_seq_len=128, lora=adapters)
    plain = Engine.load(base, backend="cuda", max_seq_len=128)
    assert cuda.backend == "cuda"
    for prefill in (len(PROMPT_IDS), 20, 7, 1):  # GEMM chunk, tc_matvec, matvec passes, decode steps
        checked = _checked_prefill(cpu, cuda, base_name, prefill)
        if checked is not None:
            err, scale, tol = checked
            assert err <= tol * scale, (base_name, prefill, err, seed)
        assert _max_err(cpu, plain, PROMPT_IDS, prefill)[0] > 1e-2  # the adapters are applied
    cands = [" Paris", " the city of lights"]
    s_cpu, s_cuda = cpu.system1("The capital of France is", cands), cuda.system1("The capital of France is", cands)
    for a, b in zip(s_cpu["candidates"], s_cuda["candidates"], strict=True):
        assert abs(a["score"] - b["score"]) <= 1e-3


# The MoE FFN's matrices (engine/models/moe_cuda.py LORA_TARGETS): router, expert stacks, shared expert. Per base
# file, those it has (qwen3moe: no shared expert), beside one attention matrix.
MOE_FFN = ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp",
           "ffn_down_shexp"]  # fmt: skip
MOE_TARGETS = {"qwen3moe": ["attn_q", *MOE_FFN[:4]], "deepseek2": MOE_FFN}


def _moe_adapters(tmp_path, gf, targets: list[str], seed: int) -> list[tuple[str, float]]:
    """Two adapters of `targets`: rank 8 F32 (rank_pad 32) and rank 40 F16 (rank_pad 64), so every adapted stack
    takes two updates and the MoE scratch is as wide as the widest."""
    out = []
    for rank, dtype, scale in ((8, np.float32, 0.7), (40, np.float16, -0.5)):
        pairs = lora_util.random_pairs(gf, targets, rank, seed + rank)
        pairs = {k: (a.astype(dtype), b.astype(dtype)) for k, (a, b) in pairs.items()}
        path = lora_util.write_adapter(tmp_path / f"m{rank}.gguf", gf.architecture, pairs, 2.0 * rank, dtype=dtype)
        out.append((path, scale))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("base_name, targets", [
    ("qwen3moe-tiny-f32", None), ("qwen3moe-tiny-q8_0", None), ("deepseek2-tiny-f32", None),
    ("deepseek2-tiny-q8_0", None),
    # one stack at a time: a gate (or up) update splits the fused SwiGLU; a down update alone keeps it
    ("qwen3moe-tiny-f32", ["ffn_gate_exps"]), ("qwen3moe-tiny-f32", ["ffn_up_exps"]),
    ("qwen3moe-tiny-f32", ["ffn_down_exps"]), ("deepseek2-tiny-f32", ["ffn_down_shexp", "ffn_gate_inp"]),
])  # fmt: skip
def test_cuda_lora_of_the_moe_family_matches_the_cpu_backend(tmp_path, base_name, targets):
    base = C.fixture_path(base_name, ".gguf")
    gf = read(base)
    targets = targets or MOE_TARGETS[gf.architecture]
    seed = _seed()
    adapters = _moe_adapters(tmp_path, gf, targets, seed)
    shorts = {t.short for a in open_adapters(adapters, gf) for t in a.tensors.values()}
    assert shorts == set(targets)  # every listed matrix exists in the file and is adapted
    cpu = Engine.load(base, backend="cpu", max_seq_len=128, lora=adapters)
    cuda = Engine.load(base, backend="cuda", max_seq_len=128, lora=adapters)
    plain = Engine.load(base, backend="cuda", max_seq_len=128)
    assert cuda.backend == "cuda"
    # the grouped expert GEMM (80 tokens), a 3-token matvec pass then decode steps, decode steps alone
    for prefill in (len(PROMPT_IDS), 3, 1):
        checked = _checked_prefill(cpu, cuda, base_name, prefill)
        if checked is not None:
            err, scale, tol = checked
            print(f"{base_name} {targets} prefill {prefill}: max abs {err:.3g}")
            assert err <= tol * scale, (base_name, targets, prefill, err, seed)
        assert _max_err(cpu, plain, PROMPT_IDS, prefill)[0] > 1e-2  # the adapters are applied
    cands = [" Paris", " the city of lights"]
    s_cpu, s_cuda = cpu.system1("The capital of France is", cands), cuda.system1("The capital of France is", cands)
    for a, b in zip(s_cpu["candidates"], s_cuda["candidates"], strict=True):
        assert abs(a["score"] - b["score"]) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["qwen3next", "qwen3next-split", "qwen35moe"])
def test_cuda_lora_of_synthetic_moe_hybrids_matches_the_cpu_backend(tmp_path, variant):
    """The fused qwen3next inputs (ssm_in, ssm_ba) and the split ones, and the MoE FFN layers' router, experts and
    shared expert (whose output the router's sigmoid gate scales)."""
    from engine.cpu import lora as cpu_lora
    from engine.cuda import load_runner
    from engine.cuda import lora as cuda_lora
    from tests.test_cuda_hybrid_model import MIXER_INPUTS, MOE_KV, random_tensors

    arch = variant.split("-")[0]
    kv = dict(MOE_KV) | ({"rope.dimension_sections": [2, 2, 0, 0]} if arch == "qwen35moe" else {})
    cfg = ModelConfig.from_gguf({"general.architecture": arch} | {f"{arch}.{k}": v for k, v in kv.items()})
    path = synthetic.write(tmp_path / f"{variant}.gguf", arch, kv, random_tensors(cfg, MIXER_INPUTS[variant],
                                                                                 synthetic.Weights(17)))  # fmt: skip
    gf = read(path)
    targets = [*MIXER_INPUTS[variant], "ssm_out", "attn_q", "attn_k", "attn_v", "attn_output", *MOE_FFN]
    adapter = lora_util.write_adapter(tmp_path / "a.gguf", arch, lora_util.random_pairs(gf, targets, 8, 5, 0.2), 8.0)
    adapters = open_adapters([(adapter, 0.8)], gf)
    cpu = synthetic.runner(path, max_seq=128)
    cpu_lora.attach(cpu.model, adapters)
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    cuda_lora.check_supported(cfg, adapters)
    gpu, _ = load_runner(cfg, gf, 128, ContextStarter(0))
    plain = synthetic.logits(gpu, list(range(3, 63)), 60)
    cuda_lora.attach(gpu.model, adapters, gpu.stream)
    ids = np.random.default_rng(11).integers(0, 64, size=60).tolist()
    for prefill in (60, 9, 3, 1):  # GEMMs and the grouped expert GEMM (60, 9), matvec passes, decode
        want, got = synthetic.logits(cpu, ids, prefill), synthetic.logits(gpu, ids, prefill)
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), (variant, prefill)
    assert np.abs(synthetic.logits(gpu, list(range(3, 63)), 60) - plain).max() > 1e-2


LLAMA_CPP_FAMILIES = ("qwen3-", "qwen3moe-", "qwen35-", "deepseek2-")  # the fixtures' bases with a CUDA model


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", sorted(f for f in FIXTURES if f.startswith(LLAMA_CPP_FAMILIES)))
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
    """The LM head (deepseek2's is untied) is the one adaptable tensor no CUDA model adapts."""
    from engine.cuda import lora as cuda_lora

    gf = read(C.fixture_path("deepseek2-tiny-f32", ".gguf"))
    pairs = lora_util.random_pairs(gf, ["output", "ffn_down_exps"], 4, seed=3)
    path = lora_util.write_adapter(tmp_path / "output.gguf", gf.architecture, pairs, 4.0)
    with pytest.raises(UnsupportedArchitecture, match=r"'output\.weight' has no CUDA path") as info:
        cuda_lora.check_supported(ModelConfig.from_gguf(gf.metadata, gf.tensors), open_adapters([(path, 1.0)], gf))
    assert info.value.kind == "unsupported_architecture"


@pytest.mark.parametrize("arch, base", [("qwen35", "qwen35-tiny-f32"), ("deepseek2", "deepseek2-tiny-f32"),
                                        ("qwen3moe", "qwen3moe-tiny-f32")])  # fmt: skip
def test_the_hybrid_mla_and_moe_cuda_models_accept_their_adapters(tmp_path, arch, base):
    from engine.cuda import lora as cuda_lora

    gf = read(C.fixture_path(base, ".gguf"))
    # ours, the MoE FFN's, and what the llama.cpp fixtures adapt
    for targets in (FAMILY_TARGETS.get(arch, []) + MOE_TARGETS.get(arch, []), lora_util.TARGETS[arch]):
        path = lora_util.write_adapter(tmp_path / "a.gguf", arch, lora_util.random_pairs(gf, targets, 4, 1), 4.0)
        cuda_lora.check_supported(ModelConfig.from_gguf(gf.metadata, gf.tensors), open_adapters([(path, 1.0)], gf))


@pytest.mark.gpu
def test_a_mismatched_adapter_is_refused_before_the_backend_is_built(tmp_path):
    dense = read(C.fixture_path("qwen3-tiny-f32", ".gguf"))
    path = lora_util.write_adapter(tmp_path / "q3.gguf", "qwen3", lora_util.random_pairs(dense, ["attn_q"], 4, 1), 4.0)
    for base in ("qwen35-tiny-f32", "deepseek2-tiny-f32"):
        with pytest.raises(InvalidInput, match="adapter for architecture 'qwen3'"):
            Engine.load(C.fixture_path(base, ".gguf"), backend="cuda", lora=[(path, 1.0)])
