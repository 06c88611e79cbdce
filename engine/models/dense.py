"""Decoders whose every layer is full attention: `qwen3` (QK-norm, NEOX RoPE), `llama` (normal RoPE, optional
`rope_freqs`) and `qwen3moe` (qwen3 attention, every FFN a mixture of experts).

Per layer:  h = x + attn_output · Attn(RoPE(q), RoPE(k), v)       (q, k, v from RMSNorm(x, attn_norm))
            out = h + FFN(RMSNorm(h, ffn_norm))                    (SwiGLU, or routed experts for qwen3moe)
"""

from __future__ import annotations

import numpy as np

from engine.config import ModelConfig
from engine.cpu import ops
from engine.cpu.kvcache import KVCache
from engine.gguf import GGUFFile
from engine.models import blocks, specs


class CpuModel(blocks.Head):
    """The NumPy reference forward pass. Weights are dequantized to float32 once, here."""

    def __init__(self, cfg: ModelConfig, gf: GGUFFile):
        super().__init__(cfg, gf, specs.dense(cfg))
        self.rope_freqs = self.top.get("rope_freqs")  # (rope_dim / 2,) or None

    def new_cache(self, limit: int, dtype: str = "f4") -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, c.value_dim, limit, dtype)

    def forward(self, ids: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """ids (n,) at positions start..start+n-1 -> final-normed hidden states (n, dim) f32."""
        c = self.cfg
        cache.reserve(start + len(ids))
        positions = np.arange(start, start + len(ids))
        rope = ops.rope_angles(positions, c.rope_dim, c.rope_theta, c.rope_scaling, self.rope_freqs)
        x = self.token_embd[ids]  # (n, dim)
        for i, L in enumerate(self.layers):
            x = x + blocks.attention(L, ops.rmsnorm(x, L["attn_norm"], c.norm_eps), c, cache, i, start, rope)
            x = x + blocks.ffn(L, ops.rmsnorm(x, L["ffn_norm"], c.norm_eps), c, i)
        return self.final_norm(x)
