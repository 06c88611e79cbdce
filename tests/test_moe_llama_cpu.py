"""Mixtral-style `llama` files (expert_count > 0): the registry row reads the MoE keys, the NumPy backend runs every
FFN as routed experts, and the result equals a naive float64 reference written here (normal RoPE pairs, GQA,
softmax over all experts, top-k renormalised, experts summed token by token)."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from engine.config import ModelConfig
from engine.errors import UnsupportedArchitecture
from engine.gguf import read
from tests import synthetic

DIM, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 4, 2, 16, 96, 2
N_EXPERTS, TOP_K, EXPERT_FF = 4, 2, 64
THETA, EPS = 10000.0, 1e-5


def llama_moe_tensors(seed: int, dim: int = DIM, n_experts: int = N_EXPERTS, expert_ff: int = EXPERT_FF,
                      vocab: int = VOCAB) -> dict[str, np.ndarray]:  # fmt: skip
    """Random weights in NumPy order (the reversed GGUF ne): expert stacks are (n_experts, out, in)."""
    w = synthetic.Weights(seed)
    t = {"token_embd.weight": w.mat(vocab, dim, std=1.0), "output_norm.weight": w.norm(dim),
         "output.weight": w.mat(vocab, dim, std=0.1)}  # fmt: skip
    for i in range(LAYERS):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": w.norm(dim), b + "ffn_norm.weight": w.norm(dim),
              b + "attn_q.weight": w.mat(HEADS * HEAD_DIM, dim, std=0.1),
              b + "attn_k.weight": w.mat(KV_HEADS * HEAD_DIM, dim, std=0.1),
              b + "attn_v.weight": w.mat(KV_HEADS * HEAD_DIM, dim, std=0.1),
              b + "attn_output.weight": w.mat(dim, HEADS * HEAD_DIM, std=0.1),
              b + "ffn_gate_inp.weight": w.mat(n_experts, dim, std=0.3),
              b + "ffn_gate_exps.weight": w.mat(n_experts, expert_ff, dim, std=0.1),
              b + "ffn_up_exps.weight": w.mat(n_experts, expert_ff, dim, std=0.1),
              b + "ffn_down_exps.weight": w.mat(n_experts, dim, expert_ff, std=0.1)}  # fmt: skip
    return t


def write_llama_moe(path: str, t: dict[str, np.ndarray], qtype: str = "F32", dim: int = DIM,
                    n_experts: int = N_EXPERTS, expert_ff: int = EXPERT_FF) -> str:  # fmt: skip
    """A llama file with experts; matrices (attention and experts, not the F32 router) of type `qtype`."""
    q = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(path, "llama")
    for key, v in {"block_count": LAYERS, "context_length": 256, "embedding_length": dim,
                   "feed_forward_length": 4 * dim, "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
                   "rope.dimension_count": HEAD_DIM, "expert_count": n_experts, "expert_used_count": TOP_K,
                   "expert_feed_forward_length": expert_ff}.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.rope.freq_base", THETA)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", EPS)
    for name, a in t.items():
        if a.ndim == 1 or name.endswith("ffn_gate_inp.weight") or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the naive reference ----------------------------------------------------------------------------------------


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rope(x, pos):
    """x (n, heads, HEAD_DIM): pairs (x[2i], x[2i+1]) turned by pos * THETA^(-2i / HEAD_DIM)."""
    angles = np.outer(pos, THETA ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM))[:, None, :]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angles)
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)


def _experts(t, b, h):
    """One token's FFN: softmax over all router logits, the TOP_K best renormalised, their SwiGLU experts summed."""
    logits = t[b + "ffn_gate_inp.weight"] @ h
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = np.argsort(-p, kind="stable")[:TOP_K]
    out = np.zeros_like(h)
    for j in top:
        g, u, d = (t[b + f"ffn_{k}_exps.weight"][j] for k in ("gate", "up", "down"))
        out += p[j] / p[top].sum() * (d @ (_silu(g @ h) * (u @ h)))
    return out


def naive_logits(t: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    t = {k: v.astype(np.float64) for k, v in t.items()}
    n, group = len(ids), HEADS // KV_HEADS
    pos = np.arange(n)
    x = t["token_embd.weight"][ids]
    for i in range(LAYERS):
        b = f"blk.{i}."
        h = _rms(x, t[b + "attn_norm.weight"])
        q = _rope((h @ t[b + "attn_q.weight"].T).reshape(n, HEADS, HEAD_DIM), pos)
        k = _rope((h @ t[b + "attn_k.weight"].T).reshape(n, KV_HEADS, HEAD_DIM), pos)
        v = (h @ t[b + "attn_v.weight"].T).reshape(n, KV_HEADS, HEAD_DIM)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # q head j reads kv head j // group
        s = np.einsum("nhd,thd->hnt", q, k) / math.sqrt(HEAD_DIM)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hnt,thd->nhd", a, v).reshape(n, HEADS * HEAD_DIM) @ t[b + "attn_output.weight"].T
        h = _rms(x, t[b + "ffn_norm.weight"])
        x = x + np.stack([_experts(t, b, h[j]) for j in range(n)])
    return _rms(x, t["output_norm.weight"]) @ t["output.weight"].T


def test_llama_with_experts_reads_the_moe_keys(tmp_path):
    path = write_llama_moe(str(tmp_path / "mixtral.gguf"), llama_moe_tensors(1))
    r = synthetic.runner(path)
    m = r.model.cfg.moe
    assert (m.n_experts, m.n_experts_used, m.expert_hidden_dim, m.shared_hidden_dim) == (N_EXPERTS, TOP_K,
                                                                                          EXPERT_FF, 0)  # fmt: skip
    assert (m.gating, m.weights_norm, m.weights_scale, m.n_dense_leading) == ("softmax", True, 1.0, 0)
    assert r.model.cfg.rope_type == "norm"
    assert read(path).tensors["blk.1.ffn_down_exps.weight"].ne == (EXPERT_FF, DIM, N_EXPERTS)


def test_llama_with_experts_equals_naive_reference(tmp_path):
    t = llama_moe_tensors(7)
    r = synthetic.runner(write_llama_moe(str(tmp_path / "mixtral.gguf"), t))
    ids = [int(i) for i in np.random.default_rng(8).integers(0, VOCAB, 30)]
    want = naive_logits(t, ids)
    assert np.abs(want).max() > 1.0  # the model is far from trivial
    for prefill in (30, 22, 1):  # one chunk; a chunk then decode steps; decode steps only
        got = synthetic.logits(r, ids, prefill=prefill)
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), err_msg=f"prefill={prefill}")


def test_merged_gate_up_stacks_are_refused_naming_the_tensor(tmp_path):
    """A file whose gate and up stacks were fused (llama.cpp's --fuse-gate-up-exps: ffn_gate_up_exps, each expert's
    gate rows then its up rows) is an unsupported_architecture naming the tensor, from the config both backends are
    built from, before any weight is read."""
    t = llama_moe_tensors(3)
    for i in range(LAYERS):
        b = f"blk.{i}."
        t[b + "ffn_gate_up_exps.weight"] = np.concatenate([t.pop(b + "ffn_gate_exps.weight"),
                                                           t.pop(b + "ffn_up_exps.weight")], axis=1)  # fmt: skip
    gf = read(write_llama_moe(str(tmp_path / "fused.gguf"), t))
    assert gf.tensors["blk.0.ffn_gate_up_exps.weight"].ne == (DIM, 2 * EXPERT_FF, N_EXPERTS)
    match = r"'blk\.\d\.ffn_gate_up_exps\.weight': merged gate/up expert stacks .*--fuse-gate-up-exps"
    with pytest.raises(UnsupportedArchitecture, match=match) as e:
        ModelConfig.from_gguf(gf.metadata, gf.tensors)
    assert e.value.kind == "unsupported_architecture"
    with pytest.raises(UnsupportedArchitecture, match=match):
        synthetic.runner(gf.path)
