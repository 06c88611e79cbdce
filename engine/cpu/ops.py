"""NumPy building blocks of the reference forward pass, written to be read against the math, all float32.

Activations are `(n_tokens, ...)`: one row per position of the chunk being processed.
"""

from __future__ import annotations

import math

import numpy as np

from engine.config import RopeScaling


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n) f32, w (n,) f32 -> x / sqrt(mean(x^2) + eps) * w."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    return (x * (1.0 / np.sqrt(ms + np.float32(eps)))) * w


def silu(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for very negative x, giving x / inf = -0, which is the right limit.
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return silu(gate) * up


def swiglu_ffn(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """h (n, dim) -> down · (silu(gate · h) ⊙ up · h), (n, dim). gate/up (hidden, dim), down (dim, hidden)."""
    return swiglu(h @ gate.T, h @ up.T) @ down.T


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)) without overflow."""
    return np.logaddexp(np.float32(0.0), x)


def l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n) / max(||x||, eps) over the last axis, as ggml's l2_norm."""
    norm = np.sqrt(np.sum(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32))
    return x / np.maximum(norm, np.float32(eps))


def yarn_corr_dims(rope_dim: int, theta: float, scaling: RopeScaling) -> tuple[float, float]:
    """The pair-index range [lo, hi] over which YaRN ramps from extrapolated to interpolated angles.

    c(beta) is the pair index whose wavelength fits beta turns into the original context:
    c(beta) = rope_dim * ln(n_ctx_orig / (2 pi beta)) / (2 ln theta).
    """

    def corr(beta: float) -> float:
        return rope_dim * math.log(scaling.original_context / (beta * 2.0 * math.pi)) / (2.0 * math.log(theta))

    lo = max(0.0, math.floor(corr(scaling.yarn_beta_fast)))
    hi = min(rope_dim - 1.0, math.ceil(corr(scaling.yarn_beta_slow)))
    return lo, hi


def rope_angles(
    positions: np.ndarray, rope_dim: int, theta: float, scaling: RopeScaling, freq_factors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (n, rope_dim // 2) f32 for integer positions (n,), already multiplied by the scaling's
    magnitude `scaling.mscale` (1 unless YaRN or rope.scaling.attn_factor say otherwise).

    Pair i turns by pos * theta^(-2i / rope_dim), divided by freq_factors[i] when the file has `rope_freqs`
    (Llama 3.1). Linear scaling divides every angle by the factor; YaRN divides only the low-frequency pairs
    (i >= hi) and ramps linearly between extrapolation (i <= lo) and interpolation, as ggml's rope_yarn does.
    """
    i = np.arange(rope_dim // 2, dtype=np.float64)
    inv_freq = theta ** (-2.0 * i / rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "yarn":
        lo, hi = yarn_corr_dims(rope_dim, theta, scaling)
        extrapolate = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)  # 1 for high-frequency pairs
        inv_freq = inv_freq / scaling.factor * (1.0 - extrapolate) + inv_freq * extrapolate
    elif scaling.kind != "none":
        raise ValueError(f"unknown RoPE scaling {scaling.kind!r}")
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    m = scaling.mscale
    return (m * np.cos(angles)).astype(np.float32), (m * np.sin(angles)).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_type: str) -> np.ndarray:
    """Rotate the first rope_dim dims of each head. x (n, heads, head_dim); cos/sin (n, rope_dim/2)."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if rope_type == "neox":  # pairs (i, i + half)
        a, b = x[..., :half], x[..., half : 2 * half]
        out[..., :half] = a * c - b * s
        out[..., half : 2 * half] = b * c + a * s
    elif rope_type == "norm":  # pairs (2i, 2i + 1)
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = a * c - b * s
        out[..., 1 : 2 * half : 2] = b * c + a * s
    else:
        raise ValueError(f"unknown rope type {rope_type!r}")
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float) -> np.ndarray:
    """Causal grouped-query attention of a chunk of queries over the cache.

    q (n, n_heads, d) for positions start..start+n-1; k (T, n_kv_heads, d) and v (T, n_kv_heads, dv) hold
    positions 0..T-1 with T = start + n. Query head h reads kv head h // (n_heads // n_kv_heads).
    Returns (n, n_heads, dv).
    """
    n, n_heads, d = q.shape
    t, n_kv, dv = v.shape
    group = n_heads // n_kv
    qg = q.reshape(n, n_kv, group, d)
    scores = np.einsum("nkgd,tkd->kgnt", qg, k, dtype=np.float32) * np.float32(scale)  # (n_kv, group, n, T)
    future = np.arange(t)[None, :] > (start + np.arange(n))[:, None]  # (n, T)
    scores[..., future] = -np.inf
    p = softmax(scores, axis=-1)
    out = np.einsum("kgnt,tkv->nkgv", p, v, dtype=np.float32)
    return out.reshape(n, n_heads, dv)
