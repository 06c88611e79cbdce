"""Pieces the model families share: loading weights by their GGUF names, the LM head, grouped-query attention
(with optional QK-norm and sigmoid output gate) and the FFN of a layer (dense SwiGLU or mixture of experts)."""

from __future__ import annotations

import math

import numpy as np

from engine.config import ModelConfig
from engine.cpu import ops
from engine.cpu.dequant import dequantize
from engine.gguf import GGUFFile, TensorInfo
from engine.models import moe
from engine.weights import TensorSpec, group_by_layer, resolve


def f32(info: TensorInfo) -> np.ndarray:
    return dequantize(info.data, info.ggml_type, info.shape)


def load(gf: GGUFFile, specs: list[TensorSpec], n_layers: int) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Resolve and dequantize every spec once, grouped by `group_by_layer` (model-level tensors by name without
    ".weight", per layer by the name within the block). NumPy shapes are the reversed GGUF ne: matrices are
    (out, in)."""
    return group_by_layer({name: f32(info) for name, info in resolve(gf, specs).items()}, n_layers)


class Head:
    """Base of the families' CpuModel: dequantizes the family's tensors once (`self.layers`, `self.top` for the
    model-level ones) and holds the head: token_embd (n_vocab, dim), output_norm (dim,), output (n_vocab, dim), which
    the runner reads."""

    def __init__(self, cfg: ModelConfig, gf: GGUFFile, specs: list[TensorSpec]):
        top, self.layers = load(gf, specs, cfg.n_layers)
        self.top = top
        self.cfg = cfg
        self.token_embd = top["token_embd"]
        self.output_norm = top["output_norm"]
        self.output = top["token_embd"] if cfg.tied_output else top["output"]

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return ops.rmsnorm(x, self.output_norm, self.cfg.norm_eps)


def attention(L: dict[str, np.ndarray], h: np.ndarray, cfg: ModelConfig, cache, slot: int, start: int,
              rope: tuple[np.ndarray, np.ndarray], gated: bool = False) -> np.ndarray:  # fmt: skip
    """Causal GQA of the normed input h (n, dim) at positions start..start+n-1 -> (n, dim), before the residual.

    QK-norm (when the layer has attn_q_norm) comes before RoPE; `rope` is (cos, sin) (n, rope_dim/2), rotating
    the first rope_dim dims of each head. `gated`: attn_q yields [q (head_dim) | gate (head_dim)] per head and
    the attention output is multiplied by sigmoid(gate) before attn_output. K/V go to cache layer `slot`.
    """
    n, c = len(h), cfg
    q = (h @ L["attn_q"].T).reshape(n, c.n_heads, -1)
    gate = None
    if gated:
        q, gate = q[..., : c.head_dim], q[..., c.head_dim :]
    k = (h @ L["attn_k"].T).reshape(n, c.n_kv_heads, c.head_dim)
    v = (h @ L["attn_v"].T).reshape(n, c.n_kv_heads, c.value_dim)
    if "attn_q_norm" in L:
        q = ops.rmsnorm(q, L["attn_q_norm"], c.norm_eps)
        k = ops.rmsnorm(k, L["attn_k_norm"], c.norm_eps)
    cos, sin = rope
    q = ops.apply_rope(q, cos, sin, c.rope_type)
    k = ops.apply_rope(k, cos, sin, c.rope_type)
    keys, values = cache.write(slot, start, k, v)
    o = ops.attention(q, keys, values, start, 1.0 / math.sqrt(c.head_dim))  # (n, n_heads, value_dim)
    if gate is not None:
        o = o * ops.sigmoid(gate)
    return o.reshape(n, c.n_heads * c.value_dim) @ L["attn_output"].T


def ffn(L: dict[str, np.ndarray], h: np.ndarray, cfg: ModelConfig, layer: int) -> np.ndarray:
    """h (n, dim), the FFN-normed residual -> (n, dim)."""
    if cfg.moe is not None and layer >= cfg.moe.n_dense_leading:
        return moe.moe_ffn(L, h, cfg.moe)
    return ops.swiglu_ffn(h, L["ffn_gate"], L["ffn_up"], L["ffn_down"])
