"""Launch wrappers for kernels/norm_rope.cu: RMSNorm of rows, and QK-norm + RoPE + the K/V cache write
(contract: kernels/README.md). Positions are in device memory (`pos`), so a launch serves every step of a graph."""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import Launch, f32, i32, ptr
from engine.cuda.k_attention import MAX_HEAD_DIM, _cache, _heads
from engine.cuda.memory import DeviceArray, need
from engine.errors import CudaError

__all__ = ["MAX_HEAD_DIM", "qk_rope_kv", "rmsnorm_rows"]


def rmsnorm_rows(x: DeviceArray, w: DeviceArray, eps: float, y: DeviceArray, n: int) -> Launch:
    """y[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w for i < n. x, y (n, K) f32 (y may be x); w (K,) f32."""
    K = w.size
    need(w, "w", "f4", K)
    need(x, "x", "f4", n * K)
    need(y, "y", "f4", n * K)
    fn = driver.module("norm_rope").fn("rmsnorm_rows")
    return Launch(fn, (n,), (256,), [ptr(x), ptr(w), f32(eps), ptr(y), i32(n), i32(K)])


def qk_rope_kv(
    q: DeviceArray,  # (n, H*hd) f32, QK-normed and rotated in place
    k: DeviceArray,  # (n, KVH*hd) f32
    v: DeviceArray,  # (n, KVH*vd) f32
    n: int, H: int, KVH: int, hd: int, vd: int,
    q_norm: DeviceArray | None,  # (hd,) f32 or None
    k_norm: DeviceArray | None,  # (hd,) f32 or None
    eps: float,
    rope_dim: int, theta: float, freq_scale: float,
    freq_factors: DeviceArray | None,  # (rope_dim/2,) f32 or None
    rope_neox: bool,
    pos: DeviceArray,  # (1,) i32: position of token 0
    k_cache: DeviceArray,  # (max_seq, KVH, hd) f32, this layer's
    v_cache: DeviceArray,  # (max_seq, KVH, vd) f32
) -> Launch:  # fmt: skip
    _heads(H, KVH, hd, vd)
    if not (0 < rope_dim <= hd and rope_dim % 2 == 0):
        raise CudaError(f"qk_rope_kv: rope_dim {rope_dim} must be even and within head_dim {hd}")
    need(q, "q", "f4", n * H * hd)
    need(k, "k", "f4", n * KVH * hd)
    need(v, "v", "f4", n * KVH * vd)
    optional = ((q_norm, "q_norm", hd), (k_norm, "k_norm", hd), (freq_factors, "freq_factors", rope_dim // 2))
    for a, name, size in optional:
        if a is not None:
            need(a, name, "f4", size)
    need(pos, "pos", "i4", 1)
    _cache(k_cache, v_cache, n, KVH, hd, vd)
    fn = driver.module("norm_rope").fn("qk_rope_kv")
    args = [ptr(q), ptr(k), ptr(v), i32(n), i32(H), i32(KVH), i32(hd), i32(vd), ptr(q_norm), ptr(k_norm), f32(eps),
            i32(rope_dim), f32(theta), f32(freq_scale), ptr(freq_factors), i32(1 if rope_neox else 0), ptr(pos),
            ptr(k_cache), ptr(v_cache)]  # fmt: skip
    return Launch(fn, (n,), (256,), args)
