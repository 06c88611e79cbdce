"""MoE models on the CUDA backend end to end: the qwen3moe llama.cpp fixtures (docs/design.md §7, the quantized bound
measured per prompt), agreement with the NumPy backend, decode graphs against direct launches, a Mixtral-style llama
file against the NumPy backend, and decode speed (tiny fixture; Qwen3-30B-A3B expert shapes over 2 layers)."""

from __future__ import annotations

import os
import statistics
import time

import gguf
import numpy as np
import pytest

from engine import models
from engine.config import ModelConfig
from engine.cpu.runner import CpuRunner
from engine.cuda import dispatch
from engine.cuda.context import ContextStarter
from engine.engine import Engine
from engine.gguf import read
from engine.models import moe as moe_np
from engine.quants import GGMLType
from engine.sampling import SamplingParams
from tests import conformance as C
from tests import cuda_util as cu
from tests import synthetic
from tests.quant_data import random_weights
from tests.test_moe_llama_cpu import llama_moe_tensors, write_llama_moe

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE_FIXTURES = ["qwen3moe-tiny-f32", "qwen3moe-tiny-q8_0"]


@pytest.fixture(scope="module", params=MOE_FIXTURES)
def pair(request):
    path = C.fixture_path(request.param, ".gguf")
    return request.param, Engine.load(path, backend="cuda", max_seq_len=512), Engine.load(path, backend="cpu")


def margins(rows: np.ndarray) -> list[float]:
    top2 = np.sort(rows, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).tolist()


def test_fixture_conformance(pair):
    """F32: <= 1e-4 of llama.cpp, prompt rows and decode steps. Q8_0: per prompt, at most 1.25 x llama.cpp's own
    distance from exact math (X.reference vs X.dequant-f32), for the batched rows and for the decode steps (against
    the same rows batched); greedy ids equal up to the first step whose margin is within the measured error."""
    name, cuda, _ = pair
    ref, npz, exact = C.load_reference(name)
    for i, p in enumerate(ref["prompts"]):
        ids, greedy = p["token_ids"], p["greedy_ids"]
        assert cuda.tokenizer.encode(p["text"]) == ids
        logits = cuda.logits(ids)
        err = float(np.abs(logits - exact[f"prompt{i}_logits"]).max())
        forced = ids + greedy[:-1]
        steps = cuda.logits(forced, prefill=len(ids))[len(ids) - 1 :]
        if C.is_quantized(name):
            bound = 1.25 * float(np.abs(npz[f"prompt{i}_logits"] - exact[f"prompt{i}_logits"]).max())
            steps_err = float(np.abs(steps - cuda.logits(forced)[len(ids) - 1 :]).max())
            want = p.get("dequant_f32_greedy_ids") or C._dequant_greedy(ref, i)
        else:
            bound = 1e-4
            steps_err = float(np.abs(steps - npz[f"prompt{i}_greedy_step_logits"]).max())
            want = greedy
        print(f"{name} prompt {i}: prompt rows {err:.3g}, steps {steps_err:.3g}, bound {bound:.3g}")
        assert err <= bound and steps_err <= bound, (name, i, err, steps_err, bound)
        out = cuda.generate(p["text"], max_tokens=len(greedy), temperature=0.0)
        assert C.greedy_agrees(out["token_ids"], want, margins(steps), err), (name, i, out["token_ids"], want)


def test_cuda_matches_cpu_backend(pair):
    """Every row and decode step against the NumPy backend. The batched path runs quantized experts through TF32
    tensor cores, whose error can flip a near-tied expert choice, so there only the F32 file is held to 1e-4 (the
    fixture test holds the quantized one to docs/design.md §7); small batches and decode are float32 math for both.
    With 2 experts a token, batches up to 64 tokens take the decode expert kernels (dispatch.moe_matvec_tokens): 40
    of them do, 100 take the grouped GEMM."""
    name, cuda, cpu = pair
    ids = cpu.tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    ids = (ids * 4)[:100]
    assert dispatch.moe_matvec_tokens(2) == 64
    for prefill in (len(ids), 40, 7, 1) if not C.is_quantized(name) else (40, 7, 1):
        a, b = cuda.logits(ids, prefill=prefill), cpu.logits(ids, prefill=prefill)
        err = float(np.abs(a - b).max())
        assert err <= 1e-4 * max(1.0, float(np.abs(b).max())), (name, prefill, err)


def test_system1_and_greedy_agree_with_cpu(pair):
    _, cuda, cpu = pair
    cands = [" Paris", " London", " the city of lights"]
    a, b = cuda.system1("The capital of France is", cands), cpu.system1("The capital of France is", cands)
    assert np.allclose([c["score"] for c in a["candidates"]], [c["score"] for c in b["candidates"]], atol=2e-3)
    assert cuda.generate("Hello", max_tokens=8)["token_ids"] == cpu.generate("Hello", max_tokens=8)["token_ids"]


def test_graphs_and_direct_launches_agree():
    graphs, direct = cu.greedy_ids_per_setting(
        "qwen3moe-tiny-q8_0", "REFLEX_CUDA_GRAPHS", ("1", "0"), (cu.LONG_PROMPT,) * 2, 12
    )
    assert graphs == direct


def _runners(path: str, max_seq: int = 256):
    from engine.cuda import load_runner

    gf = read(path)
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    cuda, _ = load_runner(cfg, gf, max_seq, ContextStarter(0))
    return cfg, cuda, gf


NEAR_TIE = 1e-3  # router logits of the k-th and the next expert this close: either backend may rightly take either


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_mixtral_style_llama_matches_numpy(tmp_path, qtype, monkeypatch):
    """Random Mixtral-style files against the NumPy backend. A seed whose NumPy run meets a near-tie in an expert
    choice is drawn again (seed 2059219369 gave two logits 2.4e-7 apart; the 16-bit expert forms took the other
    expert there), so every comparison is of well-defined choices."""
    real_route, gaps = moe_np.route, []

    def route(logits, moe, bias=None):
        top = np.sort(logits, axis=-1)[:, -moe.n_experts_used - 1 :]
        gaps.append(float((top[:, 1] - top[:, 0]).min()))
        return real_route(logits, moe, bias)

    monkeypatch.setattr(moe_np, "route", route)
    prefills = (60, 7, 1) if qtype == "F32" else (7, 1)  # a quantized file's batched path runs TF32 (see above)
    for _ in range(8):
        seed = int(np.random.default_rng().integers(2**31))
        path = write_llama_moe(str(tmp_path / f"mixtral-{qtype}-{seed}.gguf"), llama_moe_tensors(seed), qtype)
        gf = read(path)
        cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
        cpu = CpuRunner(models.family("llama").CpuModel(cfg, gf), 256)
        ids = np.random.default_rng(seed).integers(0, cfg.n_vocab, size=60).tolist()
        gaps.clear()
        wants = [synthetic.logits(cpu, ids, prefill) for prefill in prefills]
        if min(gaps) >= NEAR_TIE:
            break
    else:
        pytest.fail("eight seeds in a row met a near-tie in an expert choice")
    cfg, cuda, _ = _runners(path)
    assert cfg.arch == "llama" and cfg.moe is not None
    for prefill, want in zip(prefills, wants, strict=True):
        got = synthetic.logits(cuda, ids, prefill)
        err = float(np.abs(got - want).max())
        assert err <= 1e-4 * max(1.0, float(np.abs(want).max())), (qtype, prefill, err, seed)


# -- decode speed -------------------------------------------------------------------------------------------------


def write_qwen3_30b_shaped(path: str, n_layers: int = 2, vocab: int = 2048) -> str:
    """Qwen3-30B-A3B's shapes (dim 2048, 32 / 4 heads of 128, 128 experts, top-8, expert FFN 768) over n_layers,
    random blocks in a Q4_K_M-like mix (attention Q8_0, gate/up Q4_K, down Q4_K / Q6_K by layer), a small vocab so
    the LM head stays out of the way. No tokenizer: the runner is driven with ids."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3moe")
    for key, v in {"block_count": n_layers, "context_length": 4096, "embedding_length": 2048,
                   "feed_forward_length": 6144, "attention.head_count": 32, "attention.head_count_kv": 4,
                   "attention.key_length": 128, "attention.value_length": 128, "expert_count": 128,
                   "expert_used_count": 8, "expert_feed_forward_length": 768}.items():  # fmt: skip
        w.add_uint32(f"qwen3moe.{key}", v)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)

    def add(name: str, t: GGMLType, *shape: int) -> None:  # shape in NumPy order, the last axis contiguous
        raw = random_weights(rng, t, shape)
        w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType(int(t)))

    def vector(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.normal(size=n)).astype(np.float32))

    add("token_embd.weight", GGMLType.Q8_0, vocab, 2048)
    vector("output_norm.weight", 2048)
    for i in range(n_layers):
        b = f"blk.{i}."
        for name, rows, cols in (("attn_q", 4096, 2048), ("attn_k", 512, 2048), ("attn_v", 512, 2048),
                                 ("attn_output", 2048, 4096)):  # fmt: skip
            add(b + name + ".weight", GGMLType.Q8_0, rows, cols)
        for name, n in (("attn_q_norm", 128), ("attn_k_norm", 128), ("attn_norm", 2048), ("ffn_norm", 2048)):
            vector(b + name + ".weight", n)
        w.add_tensor(b + "ffn_gate_inp.weight", (0.02 * rng.normal(size=(128, 2048))).astype(np.float32))
        add(b + "ffn_gate_exps.weight", GGMLType.Q4_K, 128, 768, 2048)
        add(b + "ffn_up_exps.weight", GGMLType.Q4_K, 128, 768, 2048)
        add(b + "ffn_down_exps.weight", GGMLType.Q6_K if i % 2 else GGMLType.Q4_K, 128, 2048, 768)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def decode_figures(runner, steps: int = 100, replays: int = 200) -> dict:
    """Median tok/s of greedy decode steps (one graph launch + the token back, as generate does) and, for the MoE
    layers alone replayed as one graph, ms and GB/s over the expert weights a token reads."""
    from engine.cuda import memory

    runner.reset()
    params = SamplingParams()
    token, times = runner.sample_next([1, 2, 3, 4, 5, 6, 7, 8, 9], params, 0), []
    for step in range(steps + 10):
        t0 = time.perf_counter()
        token = runner.sample_next([token], params, step + 1)
        times.append(time.perf_counter() - t0)
    times = times[10:]  # warm-up (the first step captures the graph)
    model = runner.model
    layers = [(ffn, L) for ffn, L in zip(model.moe, model.layers, strict=True) if ffn is not None]
    graph = memory.Graph(runner.stream)
    with graph:
        for ffn, L in layers:
            for launch in ffn.launches(model.x, 1, L["ffn_norm"]):
                launch(runner.stream)
    graph.launch()
    timer = memory.Timer(runner.stream)
    timer.start()
    for _ in range(replays):
        graph.launch()
    moe_ms = timer.stop() / replays
    graph.destroy()
    k = model.cfg.moe.n_experts_used
    expert_bytes = sum(k * w.rows * w.row_bytes for ffn, _ in layers
                       for w in (ffn.ffn_gate_exps, ffn.ffn_up_exps, ffn.ffn_down_exps))  # fmt: skip
    med = statistics.median(times)
    p10, p90 = (float(np.percentile(times, q)) * 1e3 for q in (10, 90))
    return {"tok_s": 1.0 / med, "step_ms_p10_p90": (p10, p90),
            "moe_layers": len(layers), "moe_ms": moe_ms, "expert_mb_per_token": expert_bytes / 1e6,
            "expert_gb_s": expert_bytes / (moe_ms * 1e-3) / 1e9}  # fmt: skip


def test_decode_speed(tmp_path):
    """Figures, printed (run with -s); asserts only that the decode path runs and the MoE graph is not empty."""
    from engine.cuda import driver

    tiny = _runners(C.fixture_path("qwen3moe-tiny-q8_0", ".gguf"), 512)[1]
    print(f"\nqwen3moe-tiny-q8_0 decode ({driver.device_info()['name']}):", decode_figures(tiny))
    big = _runners(write_qwen3_30b_shaped(str(tmp_path / "qwen3-30b-a3b-shaped.gguf")), 512)[1]
    figures = decode_figures(big)
    print("Qwen3-30B-A3B expert shapes, 2 layers, Q4_K/Q6_K experts, Q8_0 attention:", figures)
    assert figures["tok_s"] > 0 and figures["moe_ms"] > 0
