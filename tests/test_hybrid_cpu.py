"""The Gated DeltaNet hybrids beyond the qwen35 fixtures: qwen3next files (grouped V heads, fused ssm_in/ssm_ba)
against the equivalent qwen35moe file (tiled V heads, split tensors, as its converter reorders them), the MoE
FFN with a gated shared expert, the full_attention_interval schedule, and multi-token system1 on qwen35."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.engine import Engine
from engine.errors import GGUFError
from tests import conformance as C
from tests import synthetic

D, VOCAB, LAYERS = 32, 40, 4
HK, HV, SK, SV, KCONV = 2, 4, 8, 8, 4  # key heads, value heads, their dims, conv kernel
R = HV // HK
KEY_DIM, VALUE_DIM = HK * SK, HV * SV
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
HEADS, KV_HEADS, HD, ROPE = 2, 1, 16, 4
E, EFF, SHARED = 4, 16, 24


def _kv(arch: str) -> dict:
    kv = {
        "block_count": LAYERS, "context_length": 128, "embedding_length": D, "feed_forward_length": 48,
        "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "attention.key_length": HD,
        "attention.value_length": HD, "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": ROPE,
        "rope.freq_base": 10000.0, "expert_count": E, "expert_used_count": 2, "expert_feed_forward_length": EFF,
        "expert_shared_feed_forward_length": SHARED, "ssm.conv_kernel": KCONV, "ssm.state_size": SK,
        "ssm.group_count": HK, "ssm.time_step_rank": HV, "ssm.inner_size": VALUE_DIM, "full_attention_interval": 2,
    }  # fmt: skip
    if arch == "qwen35moe":
        kv["rope.dimension_sections"] = [1, 1, 0, 0]
    return kv


def _common_tensors(w: synthetic.Weights) -> dict[str, np.ndarray]:
    """Everything but the Gated DeltaNet mixers: embeddings, norms, gated attention (layers 1, 3), MoE FFNs."""
    t = {"token_embd.weight": w.mat(VOCAB, D, std=1.0), "output_norm.weight": w.norm(D)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": w.norm(D), b + "post_attention_norm.weight": w.norm(D),
              b + "ffn_gate_inp.weight": w.mat(E, D, std=0.5), b + "ffn_gate_exps.weight": w.mat(E, EFF, D),
              b + "ffn_up_exps.weight": w.mat(E, EFF, D), b + "ffn_down_exps.weight": w.mat(E, D, EFF),
              b + "ffn_gate_shexp.weight": w.mat(SHARED, D), b + "ffn_up_shexp.weight": w.mat(SHARED, D),
              b + "ffn_down_shexp.weight": w.mat(D, SHARED),
              b + "ffn_gate_inp_shexp.weight": w.mat(D, std=0.5)}  # fmt: skip
        if i % 2:
            t |= {b + "attn_q.weight": w.mat(2 * HEADS * HD, D), b + "attn_k.weight": w.mat(KV_HEADS * HD, D),
                  b + "attn_v.weight": w.mat(KV_HEADS * HD, D), b + "attn_output.weight": w.mat(D, HEADS * HD),
                  b + "attn_q_norm.weight": w.norm(HD), b + "attn_k_norm.weight": w.norm(HD)}  # fmt: skip
    return t


def _grouped_mixer(w: synthetic.Weights) -> dict[str, np.ndarray]:
    """One Gated DeltaNet layer's weights with V heads in grouped order (v head j reads k head j // R)."""
    return {
        "qk": w.mat(2 * KEY_DIM, D),
        "v": w.mat(HV, SV, D),
        "z": w.mat(HV, SV, D),
        "b": w.mat(HV, D),
        "a": w.mat(HV, D),
        "ssm_a": -np.exp(w.rng.uniform(0.0, 1.5, HV)).astype(np.float32),
        "dt": w.mat(HV, std=0.5),
        "conv_qk": w.mat(2 * KEY_DIM, KCONV, std=0.5),
        "conv_v": w.mat(HV, SV, KCONV, std=0.5),
        "norm": w.norm(SV),
        "out": w.mat(D, HV, SV),
    }


def _qwen3next_mixer(m: dict, b: str, fused: bool) -> dict[str, np.ndarray]:
    t = {b + "ssm_a": m["ssm_a"], b + "ssm_dt.bias": m["dt"], b + "ssm_norm.weight": m["norm"],
         b + "ssm_out.weight": m["out"].reshape(D, VALUE_DIM),
         b + "ssm_conv1d.weight": np.concatenate([m["conv_qk"], m["conv_v"].reshape(VALUE_DIM, KCONV)])}  # fmt: skip
    # ssm_ba per k head: [b of its R v heads | a of its R v heads]
    t[b + "ssm_ba.weight"] = np.concatenate([m["b"].reshape(HK, R, D), m["a"].reshape(HK, R, D)], 1).reshape(-1, D)
    q, k = m["qk"][:KEY_DIM].reshape(HK, SK, D), m["qk"][KEY_DIM:].reshape(HK, SK, D)
    v, z = m["v"].reshape(HK, R * SV, D), m["z"].reshape(HK, R * SV, D)
    if fused:  # ssm_in per k head: [q | k | v of its R v heads | z of its R v heads]
        t[b + "ssm_in.weight"] = np.concatenate([q, k, v, z], 1).reshape(-1, D)
    else:
        t[b + "attn_qkv.weight"] = np.concatenate([m["qk"], m["v"].reshape(VALUE_DIM, D)])
        t[b + "attn_gate.weight"] = m["z"].reshape(VALUE_DIM, D)
    return t


def _qwen35_mixer(m: dict, b: str) -> dict[str, np.ndarray]:
    """The same layer as its converter writes it for qwen35: V heads tiled, v head p = grouped head perm[p]."""
    perm = np.array([(p % HK) * R + p // HK for p in range(HV)])
    return {
        b + "attn_qkv.weight": np.concatenate([m["qk"], m["v"][perm].reshape(VALUE_DIM, D)]),
        b + "attn_gate.weight": m["z"][perm].reshape(VALUE_DIM, D), b + "ssm_beta.weight": m["b"][perm],
        b + "ssm_alpha.weight": m["a"][perm], b + "ssm_a": m["ssm_a"][perm], b + "ssm_dt.bias": m["dt"][perm],
        b + "ssm_conv1d.weight": np.concatenate([m["conv_qk"], m["conv_v"][perm].reshape(VALUE_DIM, KCONV)]),
        b + "ssm_norm.weight": m["norm"], b + "ssm_out.weight": m["out"][:, perm].reshape(D, VALUE_DIM),
    }  # fmt: skip


@pytest.mark.parametrize("fused", [True, False], ids=["ssm_in", "attn_qkv"])
def test_qwen3next_grouped_heads_equal_qwen35moe_tiled_heads(tmp_path, fused):
    w = synthetic.Weights(21, std=0.3)
    common = _common_tensors(w)
    mixers = {i: _grouped_mixer(w) for i in range(0, LAYERS, 2)}
    nxt, q35 = dict(common), dict(common)
    for i, m in mixers.items():
        nxt |= _qwen3next_mixer(m, f"blk.{i}.", fused)
        q35 |= _qwen35_mixer(m, f"blk.{i}.")
    a = synthetic.runner(synthetic.write(tmp_path / "next.gguf", "qwen3next", _kv("qwen3next"), nxt))
    b = synthetic.runner(synthetic.write(tmp_path / "q35.gguf", "qwen35moe", _kv("qwen35moe"), q35))
    assert a.model.gdn.recurrent == (True, False, True, False) and a.model.gdn.v_head_order == "grouped"
    assert b.model.gdn.v_head_order == "tiled" and b.model.cfg.moe.shared_hidden_dim == SHARED
    ids = [int(i) for i in np.random.default_rng(4).integers(0, VOCAB, 14)]
    la, lb = synthetic.logits(a, ids, prefill=9), synthetic.logits(b, ids, prefill=9)
    scale = np.abs(la).max()
    assert scale > 1.0
    np.testing.assert_allclose(la, lb, atol=1e-5 * scale)  # float32 rounding apart, the same model
    # Prefill as one chunk equals the decode path: the recurrent state carries across calls.
    np.testing.assert_allclose(synthetic.logits(a, ids, prefill=len(ids)), la, atol=1e-5 * scale)


@pytest.fixture(scope="module")
def qwen35():
    return Engine.load(C.fixture_path("qwen35-tiny-f32", ".gguf"), backend="cpu", max_seq_len=128)


def test_qwen35_multi_token_system1_is_the_teacher_forced_sum(qwen35):
    prompt = "The capital of France is"
    cands = [" the city of lights", " Paris", " a large and old city"]
    r = qwen35.system1(prompt, cands)
    prompt_ids = qwen35.tokenizer.encode(prompt)
    assert sum(len(c["token_ids"]) > 1 for c in r["candidates"]) >= 2
    for c in r["candidates"]:
        ids = c["token_ids"]
        rows = qwen35.logits(prompt_ids + ids[:-1])[len(prompt_ids) - 1 :]
        want = sum(float(rows[k, t]) for k, t in enumerate(ids))
        assert math.isclose(c["score"], want, rel_tol=0, abs_tol=1e-4), (c, want)
    # Order does not matter: each candidate starts from the state right after the prompt.
    again = qwen35.system1(prompt, cands[::-1])
    assert [c["score"] for c in again["candidates"]] == pytest.approx([c["score"] for c in r["candidates"]][::-1])


def test_hybrid_generate_is_repeatable(qwen35):
    """A new request starts from zero recurrent state, whatever the request before it left behind."""
    first = qwen35.generate("def fibonacci(n):", max_tokens=6)
    qwen35.system1("Hello", [" world and more", " there"])
    assert qwen35.generate("def fibonacci(n):", max_tokens=6)["token_ids"] == first["token_ids"]


def test_missing_required_keys_are_named():
    base = {"general.architecture": "qwen35", "qwen35.vocab_size": 8} | {f"qwen35.{k}": v for k, v in _kv("q").items()}
    ModelConfig.from_gguf(base)
    for key in ("qwen35.ssm.conv_kernel", "qwen35.ssm.group_count", "qwen35.embedding_length"):
        with pytest.raises(GGUFError, match=key.replace(".", r"\.")):
            ModelConfig.from_gguf({k: v for k, v in base.items() if k != key})
    ds = {"general.architecture": "deepseek2", "deepseek2.vocab_size": 8, "deepseek2.block_count": 2,
          "deepseek2.embedding_length": 16, "deepseek2.attention.head_count": 2,
          "deepseek2.attention.key_length_mla": 12, "deepseek2.rope.dimension_count": 4}  # fmt: skip
    with pytest.raises(GGUFError, match=r"deepseek2\.attention\.kv_lora_rank"):
        ModelConfig.from_gguf(ds)
