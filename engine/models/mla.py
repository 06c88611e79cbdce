"""`deepseek2` (DeepSeek V2, V2-Lite, V3 and their relatives): multi-head latent attention in the absorbed form,
leading dense layers, then mixture-of-experts layers with always-on shared experts.

Attention of one layer (H heads; per head nope + rope query/key dims and v value dims; latent rank R):
    q = attn_q·n  or  attn_q_b·RMSNorm(attn_q_a·n, attn_q_a_norm)      -> per head [q_nope | q_pe]
    [c | k_pe] = attn_kv_a_mqa·n;  c <- RMSNorm(c, attn_kv_a_norm);  q_pe, k_pe <- RoPE (normal pairs, YaRN)
    absorbed:  Q_h = [attn_k_b[h]·q_nope_h | q_pe_h],  K_t = [c_t | k_pe_t],  V_t = c_t     (one K/V "head")
    o_h = attn_v_b[h] · softmax(Q_h·K^T · kq_scale) V;  y = attn_output · concat_h(o_h)
which equals MHA on the decompressed k_nope_h = attn_k_b[h]^T c, v_h = attn_v_b[h] c, but caches only R + rope
floats per position and layer.
"""

from __future__ import annotations

import math

import numpy as np

from engine.config import ModelConfig
from engine.cpu import ops
from engine.cpu.kvcache import LatentCache
from engine.gguf import GGUFFile
from engine.models import blocks, specs


def kq_scale(cfg: ModelConfig) -> float:
    """1/sqrt(nope + rope), times mscale^2 where mscale = a0 · (1 + 0.1 · mscale_all_dim · ln factor) and a0 is
    the cos/sin magnitude the rope applies (llama.cpp's attn_factor before its YaRN cancellation)."""
    assert cfg.mla is not None
    s = cfg.rope_scaling
    ln_factor = math.log(s.factor)
    a0 = s.mscale if s.kind == "yarn" else s.attn_factor * (1.0 + 0.1 * ln_factor)
    mscale = a0 * (1.0 + 0.1 * s.yarn_log_multiplier * ln_factor)
    return mscale * mscale / math.sqrt(cfg.mla.qk_nope_dim + cfg.rope_dim)


class CpuModel(blocks.Head):
    def __init__(self, cfg: ModelConfig, gf: GGUFFile):
        assert cfg.mla is not None
        super().__init__(cfg, gf, specs.mla(cfg))
        self.mla = cfg.mla
        self.kq_scale = kq_scale(cfg)

    def new_cache(self, limit: int, dtype: str = "f4") -> LatentCache:
        return LatentCache(self.cfg.n_layers, self.mla.kv_lora_rank + self.cfg.rope_dim, limit, dtype)

    def forward(self, ids: np.ndarray, cache: LatentCache, start: int) -> np.ndarray:
        """ids (n,) at positions start..start+n-1 -> final-normed hidden states (n, dim) f32."""
        c = self.cfg
        cache.reserve(start + len(ids))
        rope = ops.rope_angles(np.arange(start, start + len(ids)), c.rope_dim, c.rope_theta, c.rope_scaling)
        x = self.token_embd[ids]  # (n, dim)
        for i, L in enumerate(self.layers):
            x = x + self._attention(L, ops.rmsnorm(x, L["attn_norm"], c.norm_eps), cache, i, start, rope)
            x = x + blocks.ffn(L, ops.rmsnorm(x, L["ffn_norm"], c.norm_eps), c, i)
        return self.final_norm(x)

    def queries(self, L: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
        """h (n, dim) normed -> q (n, n_heads, nope + rope), before RoPE."""
        if self.mla.q_lora_rank:
            q = ops.rmsnorm(h @ L["attn_q_a"].T, L["attn_q_a_norm"], self.cfg.norm_eps) @ L["attn_q_b"].T
        else:
            q = h @ L["attn_q"].T
        return q.reshape(len(h), self.cfg.n_heads, -1)

    def latents(self, L: dict[str, np.ndarray], h: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """h (n, dim) normed -> cache rows (n, R + rope): [RMSNorm(c) | RoPE(k_pe)]."""
        r = self.mla.kv_lora_rank
        kva = h @ L["attn_kv_a_mqa"].T  # (n, R + rope)
        c = ops.rmsnorm(kva[:, :r], L["attn_kv_a_norm"], self.cfg.norm_eps)
        k_pe = ops.apply_rope(kva[:, None, r:], cos, sin, self.cfg.rope_type)[:, 0]
        return np.concatenate([c, k_pe], axis=-1)

    def _attention(self, L: dict[str, np.ndarray], h: np.ndarray, cache: LatentCache, layer: int, start: int,
                   rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:  # fmt: skip
        """h (n, dim) normed -> (n, dim), before the residual; writes this chunk's latent rows to the cache."""
        n, r, nope = len(h), self.mla.kv_lora_rank, self.mla.qk_nope_dim
        cos, sin = rope
        q = self.queries(L, h)
        q_pe = ops.apply_rope(q[..., nope:], cos, sin, self.cfg.rope_type)  # (n, H, rope)
        q_latent = np.einsum("nhi,hri->nhr", q[..., :nope], L["attn_k_b"])  # (n, H, R): absorbs attn_k_b
        rows = cache.write(layer, start, self.latents(L, h, cos, sin))[:, None, :]  # (T, 1, R + rope)
        o_latent = ops.attention(np.concatenate([q_latent, q_pe], axis=-1), rows, rows[..., :r], start, self.kq_scale)
        o = np.einsum("nhr,hvr->nhv", o_latent, L["attn_v_b"])  # (n, H, v): decompress with attn_v_b
        return o.reshape(n, -1) @ L["attn_output"].T
