"""Gated DeltaNet hybrids: `qwen35`, `qwen35moe` (Qwen3.5/3.6) and `qwen3next`.

Per layer:  h = x + mixer(RMSNorm(x, attn_norm));  out = h + FFN(RMSNorm(h, post_attention_norm))
The mixer is either a Gated DeltaNet ("linear attention", recurrent) or gated full attention (attn_q yields a
per-head sigmoid gate on the output; QK-norm; RoPE on the first rope_dim dims), by `cfg.gdn.recurrent`.

Gated DeltaNet, per token (H_k key heads of S_k dims, H_v value heads of S_v dims):
    qkv = attn_qkv·n -> causal conv1d (state: last K-1 inputs) -> silu -> q, k (H_k heads), v (H_v heads)
    q, k <- l2norm per head (q also / sqrt(S_k));  beta = sigmoid(ssm_beta·n);  z = attn_gate·n
    decay = exp(ssm_a · softplus(ssm_alpha·n + ssm_dt))      (ssm_a is stored as -exp(A_log))
    S_h <- decay S_h;  S_h <- S_h + k (beta (v - S_h^T k))^T;  o_h = S_h^T q      (v head h reads k head kh(h))
    y = ssm_out · concat_h( RMSNorm(o_h, ssm_norm) ⊙ silu(z_h) )
kh(h) is h % H_k in qwen35 files (their converter tiles the V heads) and h // (H_v / H_k) in qwen3next files.
The norm weights of these files already hold the 1 + w that the reference implementation computes at run time.
"""

from __future__ import annotations

import math

import numpy as np

from engine.config import ModelConfig
from engine.cpu import deltanet, ops
from engine.cpu.kvcache import HybridCache, KVCache
from engine.errors import GGUFError
from engine.gguf import GGUFFile
from engine.models import blocks, specs


class CpuModel(blocks.Head):
    def __init__(self, cfg: ModelConfig, gf: GGUFFile):
        assert cfg.gdn is not None
        super().__init__(cfg, gf, specs.hybrid(cfg))
        self.gdn = cfg.gdn
        # Each layer's index among the layers of its kind: its slot in the K/V cache or in the recurrent state.
        self.slots = [cfg.gdn.recurrent[:i].count(kind) for i, kind in enumerate(cfg.gdn.recurrent)]
        for i, L in enumerate(self.layers):
            if cfg.gdn.recurrent[i] and "attn_qkv" not in L and "ssm_in" not in L:
                raise GGUFError(f"layer {i} has neither 'blk.{i}.attn_qkv.weight' nor 'blk.{i}.ssm_in.weight'")

    def new_cache(self, limit: int, dtype: str = "f4") -> HybridCache:
        c, g = self.cfg, self.gdn
        n_recurrent = sum(g.recurrent)
        kv = KVCache(c.n_layers - n_recurrent, c.n_kv_heads, c.head_dim, c.value_dim, limit, dtype)
        return HybridCache(kv, n_recurrent, (g.conv_kernel - 1, g.conv_dim), (g.n_v_heads, g.head_k_dim, g.head_v_dim))

    def forward(self, ids: np.ndarray, cache: HybridCache, start: int) -> np.ndarray:
        """ids (n,) at positions start..start+n-1 -> final-normed hidden states (n, dim) f32. Advances the
        recurrent state in `cache`, so a chunk must follow the one before it (or a restored snapshot)."""
        c = self.cfg
        cache.reserve(start + len(ids))
        # Text positions: every MRoPE section turns by the same position, i.e. NEOX on the first rope_dim dims.
        rope = ops.rope_angles(np.arange(start, start + len(ids)), c.rope_dim, c.rope_theta, c.rope_scaling)
        x = self.token_embd[ids]  # (n, dim)
        for i, L in enumerate(self.layers):
            h = ops.rmsnorm(x, L["attn_norm"], c.norm_eps)
            if self.gdn.recurrent[i]:
                x = x + self._deltanet(L, h, cache, self.slots[i])
            else:
                x = x + blocks.attention(L, h, c, cache, self.slots[i], start, rope, gated=True)
            x = x + blocks.ffn(L, ops.rmsnorm(x, L["post_attention_norm"], c.norm_eps), c, i)
        return self.final_norm(x)

    def _projections(self, L: dict[str, np.ndarray], h: np.ndarray) -> tuple[np.ndarray, ...]:
        """h (n, dim) -> qkv (n, conv_dim) as [q heads | k heads | v heads], z (n, H_v*S_v), b and a (n, H_v)."""
        g, n = self.gdn, len(h)
        r = g.n_v_heads // g.n_k_heads
        if "ssm_in" in L:  # per k head: [q (S_k) | k (S_k) | v (r*S_v) | z (r*S_v)]
            m = (h @ L["ssm_in"].T).reshape(n, g.n_k_heads, -1)
            sk, sv = g.head_k_dim, r * g.head_v_dim
            parts = (m[..., :sk], m[..., sk : 2 * sk], m[..., 2 * sk : 2 * sk + sv], m[..., 2 * sk + sv :])
            q, k, v, z = (p.reshape(n, -1) for p in parts)
            qkv = np.concatenate([q, k, v], axis=-1)
        else:
            qkv, z = h @ L["attn_qkv"].T, h @ L["attn_gate"].T
        if "ssm_ba" in L:  # per k head: [b (r) | a (r)]
            ba = (h @ L["ssm_ba"].T).reshape(n, g.n_k_heads, 2 * r)
            return qkv, z, ba[..., :r].reshape(n, -1), ba[..., r:].reshape(n, -1)
        return qkv, z, h @ L["ssm_beta"].T, h @ L["ssm_alpha"].T

    def _to_v_heads(self, x: np.ndarray) -> np.ndarray:
        """(n, H_k, S_k) -> (n, H_v, S_k): the k head each v head reads (see the module docstring)."""
        r = self.gdn.n_v_heads // self.gdn.n_k_heads
        return np.tile(x, (1, r, 1)) if self.gdn.v_head_order == "tiled" else np.repeat(x, r, axis=1)

    def _deltanet(self, L: dict[str, np.ndarray], h: np.ndarray, cache: HybridCache, slot: int) -> np.ndarray:
        """h (n, dim) normed -> (n, dim), advancing conv/ssm state `slot` of the cache by n tokens."""
        g, n, eps = self.gdn, len(h), self.cfg.norm_eps
        qkv, z, b, a = self._projections(L, h)
        beta = ops.sigmoid(b)  # (n, H_v)
        decay = np.exp(L["ssm_a"] * ops.softplus(a + L["ssm_dt"]))  # (n, H_v) in (0, 1)
        mixed = ops.silu(deltanet.causal_conv(qkv, cache.conv[slot], L["ssm_conv1d"]))  # (n, conv_dim)
        key_dim = g.n_k_heads * g.head_k_dim
        q = ops.l2norm(mixed[:, :key_dim].reshape(n, g.n_k_heads, g.head_k_dim), eps)
        k = ops.l2norm(mixed[:, key_dim : 2 * key_dim].reshape(n, g.n_k_heads, g.head_k_dim), eps)
        v = mixed[:, 2 * key_dim :].reshape(n, g.n_v_heads, g.head_v_dim)
        q = q * np.float32(1.0 / math.sqrt(g.head_k_dim))
        o = deltanet.delta_rule(cache.ssm[slot], self._to_v_heads(q), self._to_v_heads(k), v, decay, beta)
        o = ops.rmsnorm(o, L["ssm_norm"], eps) * ops.silu(z.reshape(n, g.n_v_heads, g.head_v_dim))
        return o.reshape(n, -1) @ L["ssm_out"].T
