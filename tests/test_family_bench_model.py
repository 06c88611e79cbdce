"""The MoE / MLA / hybrid benchmark models (scripts/make_family_bench_model.py): configs, Q4_K_M types, a small file."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from engine import gguf
from engine.config import ModelConfig
from engine.engine import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_script():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    path = os.path.join(ROOT, "scripts", "make_family_bench_model.py")
    spec = importlib.util.spec_from_file_location("make_family_bench_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fb = _load_script()


def test_published_hyper_parameters():
    _, moe = fb.config_for("qwen3-30b-a3b", None)
    assert (moe.arch, moe.n_layers, moe.dim, moe.n_heads, moe.n_kv_heads, moe.head_dim) == (
        "qwen3moe",
        48,
        2048,
        32,
        4,
        128,
    )
    assert (moe.moe.n_experts, moe.moe.n_experts_used, moe.moe.expert_hidden_dim) == (128, 8, 768)
    assert moe.qk_norm and not moe.tied_output and moe.moe.weights_norm
    _, v2 = fb.config_for("deepseek-v2-lite", None)
    assert (v2.arch, v2.n_layers, v2.mla.kv_lora_rank, v2.mla.q_lora_rank, v2.rope_dim) == ("deepseek2", 27, 512, 0, 64)
    assert (v2.mla.qk_nope_dim, v2.mla.v_head_dim, v2.moe.n_dense_leading, v2.moe.n_experts) == (128, 128, 1, 64)
    assert (v2.moe.n_experts_used, v2.moe.shared_hidden_dim, v2.rope_scaling.kind) == (6, 2816, "yarn")
    assert v2.rope_scaling.factor == 40.0 and v2.rope_scaling.original_context == 4096 and not v2.moe.weights_norm
    _, h = fb.config_for("qwen3.5-0.8b", None)
    assert (h.arch, h.n_layers, h.dim, h.hidden_dim, h.n_vocab, h.head_dim) == ("qwen35", 24, 1024, 3584, 248320, 256)
    assert h.gdn.recurrent == tuple((i + 1) % 4 != 0 for i in range(24)) and h.tied_output
    assert (h.gdn.n_v_heads, h.gdn.head_v_dim, h.gdn.conv_kernel) == (16, 128, 4)


@pytest.mark.parametrize(
    "name, ne, want",
    [
        ("output.weight", (2048, 151936), Q.Q6_K),
        ("token_embd.weight", (2048, 151936), Q.Q4_K),
        ("blk.0.attn_v.weight", (2048, 512), Q.Q6_K),  # use_more_bits(0, 48)
        ("blk.6.attn_v.weight", (2048, 512), Q.Q4_K),
        ("blk.47.ffn_down_exps.weight", (768, 2048, 128), Q.Q6_K),
        ("blk.3.ffn_gate_inp.weight", (2048, 128), Q.F32),
        ("blk.1.attn_k_b.weight", (128, 512, 16), Q.Q5_0),  # 128-value rows: Q4_K falls back
        ("blk.0.ffn_down_exps.weight", (1408, 2048, 64), Q.Q8_0),  # Q6_K falls back
        ("blk.2.attn_qkv.weight", (1024, 6144), Q.Q5_K),
        ("blk.2.ssm_conv1d.weight", (4, 6144), Q.F32),
    ],
)
def test_q4_k_m_rules(name, ne, want):
    assert fb.q4_k_m_type(name, ne, 48, tied=False) == want


def test_full_size_plans():
    moe = fb.tensor_plan("qwen3-30b-a3b")
    assert len(moe) == 3 + 48 * 12 and sum(t.n_bytes for t in moe) / 2**30 == pytest.approx(17.28, abs=0.01)
    v2 = fb.tensor_plan("deepseek-v2-lite")
    assert sum("shexp" in t.name for t in v2) == 26 * 3 and "blk.0.ffn_gate.weight" in {t.name for t in v2}
    hy = fb.tensor_plan("qwen3.5-0.8b")
    assert (
        sum(t.name.endswith("ssm_out.weight") for t in hy) == 18
        and sum(t.name.endswith("attn_q.weight") for t in hy) == 6
    )


@pytest.mark.parametrize("ggml_type", [Q.Q5_0, Q.Q5_K])
def test_new_blocks_dequantize_to_small_centred_weights(ggml_type):
    t = fb.mb.TensorSpec("blk.0.ffn_up.weight", (1024, 512), ggml_type)
    w = dequantize(fb.tensor_data(t, seed=3).reshape(-1), ggml_type)
    assert np.isfinite(w).all() and abs(float(w.mean())) < 1e-3 and 0.019 < float(w.std()) < 0.021


@pytest.fixture(scope="module")
def hybrid_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("bench") / "qwen3.5-4layers.gguf")
    assert fb.main(["--shape", "qwen3.5-0.8b", "--layers", "4", "--out", path]) == 0
    return path


def test_hybrid_file_reads_back_and_runs(hybrid_file):
    gf = gguf.read(hybrid_file)
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    assert (cfg.arch, cfg.n_layers, cfg.n_vocab, cfg.gdn.recurrent) == ("qwen35", 4, 248320, (True, True, True, False))
    assert {t.name: t.ne for t in fb.tensor_plan("qwen3.5-0.8b", 4)} == {n: t.ne for n, t in gf.tensors.items()}
    tokens = gf.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 248320 and tokens[-1] == f"<|unused_{248320 - 151936 - 1}|>"
    engine = Engine.load(hybrid_file, backend="cpu", max_seq_len=32)
    logits = engine.logits(engine.tokenizer.encode("The capital of France is"))  # (5, 248320) f32
    assert np.isfinite(logits).all() and 0.05 < float(logits.std()) < 10
