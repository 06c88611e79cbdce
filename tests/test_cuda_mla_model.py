"""deepseek2 (MLA) on the CUDA backend end to end: the llama.cpp fixtures (docs/design.md §7, the quantized bound
measured per prompt), agreement with the NumPy backend, decode graphs against direct launches, synthetic files the
fixtures do not cover (q-LoRA, YaRN, sigmoid routing with groups; an all-dense one for the attention alone; a qwen3
file with YaRN) against the NumPy backend, and decode speed with DeepSeek-V2-Lite attention shapes."""

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
from engine.cuda.context import ContextStarter
from engine.engine import Engine
from engine.gguf import read
from engine.quants import GGMLType
from engine.sampling import SamplingParams
from tests import conformance as C
from tests import cuda_util as cu
from tests import synthetic
from tests.quant_data import random_weights

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLA_FIXTURES = ["deepseek2-tiny-f32", "deepseek2-tiny-q8_0"]


@pytest.fixture(scope="module", params=MLA_FIXTURES)
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
    assert cuda.backend == "cuda"
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
    """Every row and decode step against the NumPy backend: the batched path (GEMM, causal attention over 100
    tokens), 8-token matvec passes and single-token decode. Quantized GEMMs run in TF32 (docs/design.md §7 holds the
    fixture test to its bound), so for Q8_0 only the float32 matvec paths are compared this tightly."""
    name, cuda, cpu = pair
    ids = cpu.tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    ids = (ids * 4)[:100]
    for prefill in (len(ids), 7, 1) if not C.is_quantized(name) else (7, 1):
        a, b = cuda.logits(ids, prefill=prefill), cpu.logits(ids, prefill=prefill)
        err = float(np.abs(a - b).max())
        assert err <= 1e-4 * max(1.0, float(np.abs(b).max())), (name, prefill, err)


def test_system1_and_greedy_agree_with_cpu(pair):
    _, cuda, cpu = pair
    cands = [" Paris", " London", " the city of lights"]
    a, b = cuda.system1("The capital of France is", cands), cpu.system1("The capital of France is", cands)
    assert [c["token_ids"] for c in a["candidates"]] == [c["token_ids"] for c in b["candidates"]]
    assert np.allclose([c["score"] for c in a["candidates"]], [c["score"] for c in b["candidates"]], atol=2e-3)
    assert a["backend"] == "cuda"
    assert cuda.generate("Hello", max_tokens=8)["token_ids"] == cpu.generate("Hello", max_tokens=8)["token_ids"]


def test_graphs_and_direct_launches_agree():
    graphs, direct = cu.greedy_ids_per_setting(
        "deepseek2-tiny-q8_0", "REFLEX_CUDA_GRAPHS", ("1", "0"), (cu.LONG_PROMPT,) * 2, 12
    )
    assert graphs == direct


# -- synthetic files against the NumPy backend --------------------------------------------------------------------

# Every matrix the kernels see needs K a multiple of 32: dim 128, nope 32, v 32 (H * v = 128), q-LoRA 64, experts 64.
D, H, R, NOPE, ROPE, V, VOCAB, FF, E, EFF, LAYERS = 128, 4, 64, 32, 16, 32, 300, 128, 8, 64, 3
V3_LIKE = dict(q_lora=64, gating=2, groups=4, groups_used=2, norm=True, scale=2.5, yarn=True, bias=True, dense=1)
V2_LIKE = dict(q_lora=None, gating=None, groups=1, groups_used=1, norm=False, scale=1.0, yarn=False, bias=False,
               dense=1)  # fmt: skip
ALL_DENSE = dict(V3_LIKE, dense=LAYERS)  # the attention alone (q-LoRA, YaRN) with dense FFNs


def deepseek2_metadata(o: dict) -> dict:
    kv = {
        "block_count": LAYERS, "context_length": 512, "embedding_length": D, "feed_forward_length": FF,
        "attention.head_count": H, "attention.head_count_kv": 1, "attention.key_length": R + ROPE,
        "attention.value_length": R, "attention.key_length_mla": NOPE + ROPE, "attention.value_length_mla": V,
        "attention.kv_lora_rank": R, "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": ROPE,
        "rope.freq_base": 100.0, "expert_count": E, "expert_used_count": 2, "expert_group_count": o["groups"],
        "expert_group_used_count": o["groups_used"], "expert_feed_forward_length": EFF, "expert_shared_count": 1,
        "expert_weights_scale": o["scale"], "expert_weights_norm": o["norm"], "leading_dense_block_count": o["dense"],
    }  # fmt: skip
    if o["q_lora"]:
        kv["attention.q_lora_rank"] = o["q_lora"]
    if o["gating"]:
        kv["expert_gating_func"] = o["gating"]
    if o["yarn"]:  # a short original context, so the 60 test positions reach the interpolated pairs
        kv |= {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
               "rope.scaling.yarn_log_multiplier": 0.0707}  # fmt: skip
    return kv


def deepseek2_tensors(o: dict, w: synthetic.Weights) -> dict[str, np.ndarray]:
    t = {"token_embd.weight": w.mat(VOCAB, D, std=1.0), "output_norm.weight": w.norm(D),
         "output.weight": w.mat(VOCAB, D)}  # fmt: skip
    for i in range(LAYERS):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": w.norm(D), b + "ffn_norm.weight": w.norm(D)}
        if o["q_lora"]:
            t |= {b + "attn_q_a.weight": w.mat(o["q_lora"], D), b + "attn_q_a_norm.weight": w.norm(o["q_lora"]),
                  b + "attn_q_b.weight": w.mat(H * (NOPE + ROPE), o["q_lora"])}  # fmt: skip
        else:
            t[b + "attn_q.weight"] = w.mat(H * (NOPE + ROPE), D)
        t |= {b + "attn_kv_a_mqa.weight": w.mat(R + ROPE, D), b + "attn_kv_a_norm.weight": w.norm(R),
              b + "attn_k_b.weight": w.mat(H, R, NOPE), b + "attn_v_b.weight": w.mat(H, V, R),
              b + "attn_output.weight": w.mat(D, H * V)}  # fmt: skip
        if i < o["dense"]:
            t |= {b + "ffn_gate.weight": w.mat(FF, D), b + "ffn_up.weight": w.mat(FF, D),
                  b + "ffn_down.weight": w.mat(D, FF)}  # fmt: skip
            continue
        t |= {b + "ffn_gate_inp.weight": w.mat(E, D, std=0.5), b + "ffn_gate_exps.weight": w.mat(E, EFF, D),
              b + "ffn_up_exps.weight": w.mat(E, EFF, D), b + "ffn_down_exps.weight": w.mat(E, D, EFF),
              b + "ffn_gate_shexp.weight": w.mat(EFF, D), b + "ffn_up_shexp.weight": w.mat(EFF, D),
              b + "ffn_down_shexp.weight": w.mat(D, EFF)}  # fmt: skip
        if o["bias"]:
            t[b + "exp_probs_b.bias"] = w.mat(E, std=0.3)
    return t


def _runners(path: str, max_seq: int = 256):
    from engine.cuda import load_runner

    gf = read(path)
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    cuda, _ = load_runner(cfg, gf, max_seq, ContextStarter(0))
    cpu = CpuRunner(models.family(cfg.arch).CpuModel(cfg, gf), max_seq)
    return cfg, cuda, cpu


def check_against_numpy(path: str, n_ids: int = 60) -> None:
    """Every row: one batch (the GEMM when n > 48), 7-token chunks (matvecs), and decode steps from token 1."""
    cfg, cuda, cpu = _runners(path)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, cfg.n_vocab, n_ids)]
    for prefill in (n_ids, 7, 1):
        want, got = synthetic.logits(cpu, ids, prefill), synthetic.logits(cuda, ids, prefill)
        assert np.abs(want).max() > 1.0  # far from trivial
        err = float(np.abs(got - want).max())
        assert err <= 1e-4 * max(1.0, float(np.abs(want).max())), (path, prefill, err)


@pytest.mark.parametrize("o", [V3_LIKE, V2_LIKE, ALL_DENSE], ids=["qlora-sigmoid-groups-yarn", "plain-q", "all-dense"])
def test_synthetic_deepseek2_matches_numpy(tmp_path, o):
    path = synthetic.write(
        tmp_path / "ds.gguf", "deepseek2", deepseek2_metadata(o), deepseek2_tensors(o, synthetic.Weights(7))
    )
    cfg = ModelConfig.from_gguf(read(path).metadata, read(path).tensors)
    assert (cfg.mla.q_lora_rank, cfg.rope_scaling.kind) == (o["q_lora"] or 0, "yarn" if o["yarn"] else "none")
    check_against_numpy(path)


def test_synthetic_qwen3_yarn_matches_numpy(tmp_path):
    """The dense family with YaRN (a Qwen3 128K-style file: cos/sin magnitude 1 + 0.1 ln 4) against NumPy."""
    dim, heads, kv_heads, hd, hidden, vocab, layers = 128, 4, 2, 32, 256, 300, 2
    w = synthetic.Weights(5)
    kv = {"block_count": layers, "context_length": 512, "embedding_length": dim, "feed_forward_length": hidden,
          "attention.head_count": heads, "attention.head_count_kv": kv_heads, "attention.key_length": hd,
          "attention.value_length": hd, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1000.0,
          "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
          "rope.scaling.original_context_length": 32}  # fmt: skip
    t = {"token_embd.weight": w.mat(vocab, dim, std=1.0), "output_norm.weight": w.norm(dim)}
    for i in range(layers):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": w.norm(dim), b + "ffn_norm.weight": w.norm(dim),
              b + "attn_q.weight": w.mat(heads * hd, dim), b + "attn_k.weight": w.mat(kv_heads * hd, dim),
              b + "attn_v.weight": w.mat(kv_heads * hd, dim), b + "attn_output.weight": w.mat(dim, heads * hd),
              b + "attn_q_norm.weight": w.norm(hd), b + "attn_k_norm.weight": w.norm(hd),
              b + "ffn_gate.weight": w.mat(hidden, dim), b + "ffn_up.weight": w.mat(hidden, dim),
              b + "ffn_down.weight": w.mat(dim, hidden)}  # fmt: skip
    path = synthetic.write(tmp_path / "qwen3-yarn.gguf", "qwen3", kv, t)
    cfg = ModelConfig.from_gguf(read(path).metadata, read(path).tensors)
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.mscale > 1.1
    check_against_numpy(path)


# -- decode speed -------------------------------------------------------------------------------------------------


def write_v2_lite_attention(path: str, n_layers: int = 4, vocab: int = 2048) -> str:
    """DeepSeek-V2-Lite's attention (dim 2048, 16 heads, kv_lora 512, rope 64, nope 128, v 128; attention matrices
    Q8_0) over n_layers dense layers with a small FFN (1408; gate/up Q4_K, down Q8_0), so the figures are the
    attention's."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "deepseek2")
    dim, heads, r, rope, nope, v, ff = 2048, 16, 512, 64, 128, 128, 1408
    for key, val in {"block_count": n_layers, "context_length": 4096, "embedding_length": dim,
                     "feed_forward_length": ff, "attention.head_count": heads, "attention.head_count_kv": 1,
                     "attention.key_length": r + rope, "attention.value_length": r,
                     "attention.key_length_mla": nope + rope, "attention.value_length_mla": v,
                     "attention.kv_lora_rank": r, "rope.dimension_count": rope, "expert_count": 64,
                     "expert_used_count": 6, "expert_feed_forward_length": 1408,
                     "leading_dense_block_count": n_layers}.items():  # fmt: skip
        w.add_uint32(f"deepseek2.{key}", val)
    w.add_float32("deepseek2.rope.freq_base", 10000.0)
    w.add_float32("deepseek2.attention.layer_norm_rms_epsilon", 1e-6)

    def add(name: str, t: GGMLType, *shape: int) -> None:  # shape in NumPy order, the last axis contiguous
        raw = random_weights(rng, t, shape)
        w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType(int(t)))

    def vector(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.normal(size=n)).astype(np.float32))

    add("token_embd.weight", GGMLType.Q8_0, vocab, dim)
    add("output.weight", GGMLType.Q8_0, vocab, dim)
    vector("output_norm.weight", dim)
    for i in range(n_layers):
        b = f"blk.{i}."
        for name, n in (("attn_norm", dim), ("ffn_norm", dim), ("attn_kv_a_norm", r)):
            vector(b + name + ".weight", n)
        add(b + "attn_q.weight", GGMLType.Q8_0, heads * (nope + rope), dim)
        add(b + "attn_kv_a_mqa.weight", GGMLType.Q8_0, r + rope, dim)
        add(b + "attn_k_b.weight", GGMLType.Q8_0, heads, r, nope)
        add(b + "attn_v_b.weight", GGMLType.Q8_0, heads, v, r)
        add(b + "attn_output.weight", GGMLType.Q8_0, dim, heads * v)
        add(b + "ffn_gate.weight", GGMLType.Q4_K, ff, dim)
        add(b + "ffn_up.weight", GGMLType.Q4_K, ff, dim)
        add(b + "ffn_down.weight", GGMLType.Q8_0, dim, ff)  # 1408 columns: not whole Q4_K blocks
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def decode_figures(runner, context: int, steps: int = 50, replays: int = 100) -> dict:
    """At a context of `context` tokens: median tok/s of greedy decode steps (one graph + the token back, as generate
    does) and the attention launches of every layer (one token, n_splits keys) replayed as one graph."""
    from engine.cuda import memory

    runner.reset()
    params = SamplingParams()
    ids = [int(i) for i in np.random.default_rng(1).integers(0, runner.n_vocab, context)]
    token, times = runner.sample_next(ids, params, 0), []
    for step in range(steps + 10):
        t0 = time.perf_counter()
        token = runner.sample_next([token], params, step + 1)
        times.append(time.perf_counter() - t0)
    times = times[10:]  # warm-up (the first step captures the graph)
    model = runner.model
    graph = memory.Graph(runner.stream)
    with graph:
        for i, L in enumerate(model.layers):
            for launch in model._attention(L, i, 1):
                launch(runner.stream)
    graph.launch()
    timer = memory.Timer(runner.stream)
    timer.start()
    for _ in range(replays):
        graph.launch()
    attn_ms = timer.stop() / replays
    graph.destroy()
    med = statistics.median(times)
    return {"context": context, "tok_s": round(1.0 / med, 1),
            "step_ms_p10_p90": (round(np.percentile(times, 10) * 1e3, 3), round(np.percentile(times, 90) * 1e3, 3)),
            "layers": len(model.layers), "attention_ms_all_layers": round(attn_ms, 4)}  # fmt: skip


def test_decode_speed(tmp_path):
    """Figures, printed (run with -s); asserts only that decode runs."""
    from engine.cuda import driver, load_runner

    tiny = Engine.load(C.fixture_path("deepseek2-tiny-q8_0", ".gguf"), backend="cuda", max_seq_len=4200)
    print(f"\ndeepseek2-tiny-q8_0 decode ({driver.device_info()['name']}):", decode_figures(tiny.runner, 100))
    gf = read(write_v2_lite_attention(str(tmp_path / "v2-lite-attention.gguf")))
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    big, _ = load_runner(cfg, gf, 4200, ContextStarter(0))
    for context in (100, 1000, 4000):
        figures = decode_figures(big, context)
        print("DeepSeek-V2-Lite attention shapes, 4 dense layers, Q8_0 attention:", figures)
        assert figures["tok_s"] > 0
