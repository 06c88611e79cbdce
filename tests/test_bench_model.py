"""The Qwen3-0.6B-shaped benchmark model (scripts/make_bench_model.py): tensor plan, blocks, and a 2-layer file."""

from __future__ import annotations

import importlib.util
import json
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
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
MORE_BITS_28 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27}  # gguf-kernels-architectures.md §1.4


def _load_script():
    path = os.path.join(ROOT, "scripts", "make_bench_model.py")
    spec = importlib.util.spec_from_file_location("make_bench_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


mb = _load_script()


def test_use_more_bits_layers():
    assert {i for i in range(28) if mb.use_more_bits(i, 28)} == MORE_BITS_28
    assert [mb.use_more_bits(i, 2) for i in range(2)] == [False, True]


def test_28_layer_plans_have_the_published_type_counts():
    q4 = mb.tensor_plan("q4_k_m")
    assert len(q4) == 310 and "output.weight" not in {t.name for t in q4}
    assert mb.type_counts(q4) == {"f32": 113, "q4_K": 168, "q6_K": 29}
    q6 = {t.name for t in q4 if t.ggml_type == Q.Q6_K}
    assert q6 == {"token_embd.weight"} | {f"blk.{i}.{k}.weight" for i in MORE_BITS_28 for k in ("attn_v", "ffn_down")}
    assert mb.type_counts(mb.tensor_plan("q8_0")) == {"f32": 113, "q8_0": 197}


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0"])
def test_2_layer_plan_matches_llama_quantize_output(quant):
    """The tiny qwen3 fixtures were quantized by llama-quantize from a 2-layer tied model: same order and types."""
    with open(os.path.join(FIXTURES, f"qwen3-tiny-{quant}.reference.json")) as f:
        want = [(t["name"], t["type"]) for t in json.load(f)["gguf"]["tensors"]]
    assert [(t.name, t.ggml_type.name) for t in mb.tensor_plan(quant, 2)] == want


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K, Q.Q8_0])
def test_blocks_dequantize_to_small_centred_weights(ggml_type):
    t = mb.TensorSpec("blk.0.ffn_up.weight", (1024, 512), ggml_type)
    blocks = mb.tensor_data(t, seed=3)
    assert blocks.dtype == np.uint8 and blocks.nbytes == t.n_bytes
    w = dequantize(blocks.reshape(-1), ggml_type)  # (512 * 1024,) f32
    assert np.isfinite(w).all()
    assert abs(float(w.mean())) < 1e-3
    assert 0.019 < float(w.std()) < 0.021
    assert np.array_equal(blocks, mb.tensor_data(t, seed=3))
    assert not np.array_equal(blocks, mb.tensor_data(t, seed=4))


def test_norms_are_near_one():
    v = mb.tensor_data(mb.TensorSpec("output_norm.weight", (1024,), Q.F32), seed=0)  # (1024,) f32
    assert v.dtype == np.float32 and v.shape == (1024,)
    assert v.min() >= 0.95 and v.max() <= 1.05


@pytest.fixture(scope="module")
def two_layer(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("bench") / "qwen3-shaped-2layers.gguf")
    assert mb.main(["--quant", "q4_k_m", "--layers", "2", "--seed", "7", "--out", path]) == 0
    return path


def test_2_layer_file_layout(two_layer):
    gf = gguf.read(two_layer)
    q4, q6 = Q.Q4_K.value, Q.Q6_K.value
    want = {"output_norm": (0, (1024,)), "token_embd": (q6, (1024, 151936))}
    per_layer = {"attn_norm": (0, (1024,)), "attn_q": (q4, (1024, 2048)), "attn_k": (q4, (1024, 1024)),
                 "attn_output": (q4, (2048, 1024)), "attn_q_norm": (0, (128,)), "attn_k_norm": (0, (128,)),
                 "ffn_norm": (0, (1024,)), "ffn_gate": (q4, (1024, 3072)), "ffn_up": (q4, (1024, 3072))}  # fmt: skip
    for i in range(2):
        more = q6 if mb.use_more_bits(i, 2) else q4
        want |= {f"blk.{i}.{k}": v for k, v in per_layer.items()}
        want |= {f"blk.{i}.attn_v": (more, (1024, 1024)), f"blk.{i}.ffn_down": (more, (3072, 1024))}
    got = {name.removesuffix(".weight"): (int(t.ggml_type), t.ne) for name, t in gf.tensors.items()}
    assert got == want
    assert [n for n in gf.tensors][:3] == ["output_norm.weight", "token_embd.weight", "blk.0.attn_k.weight"]

    md = gf.metadata
    assert md["general.architecture"] == "qwen3" and md["general.file_type"] == 15
    assert md["general.quantization_version"] == 2 and "general.alignment" not in md
    vocab = gguf.read(os.path.join(FIXTURES, "tokenizer", "qwen3-vocab.gguf")).metadata
    for key, _, _ in mb.TOKENIZER_KEYS:
        assert np.array_equal(md[key], vocab[key]) if isinstance(vocab[key], np.ndarray) else md[key] == vocab[key]


def test_2_layer_config(two_layer):
    gf = gguf.read(two_layer)
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    assert (cfg.arch, cfg.n_layers, cfg.dim, cfg.hidden_dim) == ("qwen3", 2, 1024, 3072)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.value_dim) == (16, 8, 128, 128)
    assert (cfg.n_vocab, cfg.n_ctx, cfg.rope_theta, cfg.rope_dim) == (151936, 40960, 1e6, 128)
    assert cfg.norm_eps == pytest.approx(1e-6) and cfg.tied_output and cfg.qk_norm and cfg.moe is None


def test_2_layer_cpu_forward_is_finite(two_layer):
    engine = Engine.load(two_layer, backend="cpu", max_seq_len=32)
    ids = engine.tokenizer.encode("The capital of France is")
    logits = engine.logits(ids)  # (5, 151936) f32
    assert logits.shape == (len(ids), 151936) and np.isfinite(logits).all()
    assert 0.1 < float(logits.std()) < 10
    r = engine.generate("Hello", max_tokens=2)
    assert len(r["token_ids"]) == 2 and all(0 <= t < 151936 for t in r["token_ids"])
