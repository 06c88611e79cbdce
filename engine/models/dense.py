"""Dense decoder families: `qwen3` (QK-norm, NEOX RoPE) and `llama` (normal RoPE, optional `rope_freqs`).

Per layer:  h = x + attn_output · Attn(RoPE(q), RoPE(k), v)       (q, k, v from RMSNorm(x, attn_norm))
            out = h + ffn_down · (silu(ffn_gate · n) ⊙ ffn_up · n)    (n = RMSNorm(h, ffn_norm))
"""

from __future__ import annotations

import math

import numpy as np

from engine.config import ModelConfig
from engine.cpu import ops
from engine.cpu.dequant import dequantize
from engine.cpu.kvcache import KVCache
from engine.gguf import GGUFFile, TensorInfo
from engine.weights import TensorSpec, resolve


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    d, hd, vd = cfg.dim, cfg.head_dim, cfg.value_dim
    specs = [
        TensorSpec("token_embd.weight", (d, cfg.n_vocab)),
        TensorSpec("output_norm.weight", (d,)),
        TensorSpec("output.weight", (d, cfg.n_vocab), required=not cfg.tied_output),
        TensorSpec("rope_freqs.weight", (cfg.rope_dim // 2,), required=False),
    ]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        specs += [
            TensorSpec(b + "attn_norm.weight", (d,)),
            TensorSpec(b + "attn_q.weight", (d, cfg.n_heads * hd)),
            TensorSpec(b + "attn_k.weight", (d, cfg.n_kv_heads * hd)),
            TensorSpec(b + "attn_v.weight", (d, cfg.n_kv_heads * vd)),
            TensorSpec(b + "attn_output.weight", (cfg.n_heads * vd, d)),
            TensorSpec(b + "attn_q_norm.weight", (hd,), required=cfg.qk_norm),
            TensorSpec(b + "attn_k_norm.weight", (hd,), required=cfg.qk_norm),
            TensorSpec(b + "ffn_norm.weight", (d,)),
            TensorSpec(b + "ffn_gate.weight", (d, cfg.hidden_dim)),
            TensorSpec(b + "ffn_up.weight", (d, cfg.hidden_dim)),
            TensorSpec(b + "ffn_down.weight", (cfg.hidden_dim, d)),
        ]
    return specs


def _f32(info: TensorInfo) -> np.ndarray:
    return dequantize(info.data, info.ggml_type, info.shape)


class CpuModel:
    """The NumPy reference forward pass. Weights are dequantized to float32 once, here."""

    def __init__(self, cfg: ModelConfig, gf: GGUFFile):
        self.cfg = cfg
        infos = resolve(gf, tensor_specs(cfg))
        self.token_embd = _f32(infos["token_embd.weight"])  # (n_vocab, dim)
        self.output_norm = _f32(infos["output_norm.weight"])  # (dim,)
        self.output = self.token_embd if cfg.tied_output else _f32(infos["output.weight"])  # (n_vocab, dim)
        freqs = infos.get("rope_freqs.weight")
        self.rope_freqs = _f32(freqs) if freqs is not None else None  # (rope_dim / 2,)
        self.layers = [
            {name.split(".")[2]: _f32(info) for name, info in infos.items() if name.startswith(f"blk.{i}.")}
            for i in range(cfg.n_layers)
        ]

    def new_cache(self, limit: int) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, c.value_dim, limit)

    def forward(self, ids: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """ids (n,) at positions start..start+n-1 -> final-normed hidden states (n, dim) f32."""
        c = self.cfg
        n = len(ids)
        cache.reserve(start + n)
        cos, sin = ops.rope_angles(np.arange(start, start + n), c.rope_dim, c.rope_theta, c.rope_scaling,
                                   self.rope_freqs)  # fmt: skip
        x = self.token_embd[ids]  # (n, dim)
        for i, L in enumerate(self.layers):
            h = ops.rmsnorm(x, L["attn_norm"], c.norm_eps)
            q = (h @ L["attn_q"].T).reshape(n, c.n_heads, c.head_dim)
            k = (h @ L["attn_k"].T).reshape(n, c.n_kv_heads, c.head_dim)
            v = (h @ L["attn_v"].T).reshape(n, c.n_kv_heads, c.value_dim)
            if c.qk_norm:
                q = ops.rmsnorm(q, L["attn_q_norm"], c.norm_eps)
                k = ops.rmsnorm(k, L["attn_k_norm"], c.norm_eps)
            q = ops.apply_rope(q, cos, sin, c.rope_type)
            k = ops.apply_rope(k, cos, sin, c.rope_type)
            keys, values = cache.write(i, start, k, v)
            o = ops.attention(q, keys, values, start, 1.0 / math.sqrt(c.head_dim))
            x = x + o.reshape(n, c.n_heads * c.value_dim) @ L["attn_output"].T
            h = ops.rmsnorm(x, L["ffn_norm"], c.norm_eps)
            x = x + ops.swiglu(h @ L["ffn_gate"].T, h @ L["ffn_up"].T) @ L["ffn_down"].T
        return ops.rmsnorm(x, self.output_norm, c.norm_eps)
