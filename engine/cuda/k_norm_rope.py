"""Launch wrappers for kernels/norm_rope.cu: RMSNorm of rows, QK-norm + RoPE + the K/V cache write, and MLA's latent
norm + RoPE + latent-cache write (contract: kernels/README.md). Positions are in device memory (`pos`), so a launch
serves every step of a graph."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import RopeScaling
from engine.cuda import driver
from engine.cuda.driver import Launch, f32, i32, ptr
from engine.cuda.k_attention import MAX_HEAD_DIM, _cache, _heads, kv_kernel, need_cache
from engine.cuda.memory import DeviceArray, need
from engine.errors import CudaError

__all__ = ["MAX_HEAD_DIM", "Yarn", "mla_kv_rope", "qk_rope_kv", "rmsnorm_rows", "rope_scaling"]


@dataclass(frozen=True)
class Yarn:
    """What the kernels take beyond the plain frequency scale: pair i's angle mixes the unscaled angle back in by
    mix_i = ext_factor * (1 - clamp((i - corr_lo) / max(0.001, corr_hi - corr_lo), 0, 1)) (YaRN's ramp; ext_factor
    0 turns it off), and cos / sin are multiplied by mscale (config.RopeScaling.mscale)."""

    ext_factor: float = 0.0
    corr_lo: float = 0.0
    corr_hi: float = 0.0
    mscale: float = 1.0


NO_YARN = Yarn()


def rope_scaling(rope_dim: int, theta: float, s: RopeScaling) -> tuple[float, Yarn]:
    """(freq_scale, Yarn) of a config's RoPE scaling, as engine/cpu/ops.rope_angles applies it: linear and YaRN divide
    angles by the factor, YaRN only past its ramp. The ramp ends are ops.yarn_corr_dims' formula, repeated here
    because ops imports NumPy and this is the CUDA cold path."""
    if s.kind == "none":
        return 1.0, Yarn(mscale=s.mscale)
    if s.kind == "linear":
        return 1.0 / s.factor, Yarn(mscale=s.mscale)
    if s.kind != "yarn":
        raise CudaError(f"RoPE scaling {s.kind!r} has no kernel parameters")

    def corr(beta: float) -> float:  # the pair whose wavelength fits beta turns into the original context
        return rope_dim * math.log(s.original_context / (beta * 2.0 * math.pi)) / (2.0 * math.log(theta))

    lo = max(0.0, math.floor(corr(s.yarn_beta_fast)))
    hi = min(rope_dim - 1.0, math.ceil(corr(s.yarn_beta_slow)))
    return 1.0 / s.factor, Yarn(ext_factor=1.0, corr_lo=lo, corr_hi=hi, mscale=s.mscale)


def _yarn_args(yarn: Yarn) -> list:
    return [f32(yarn.ext_factor), f32(yarn.corr_lo), f32(yarn.corr_hi), f32(yarn.mscale)]


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
    k_cache: DeviceArray,  # (max_seq, KVH, hd) f32 or f16, this layer's
    v_cache: DeviceArray,  # (max_seq, KVH, vd), the same element
    *,
    yarn: Yarn = NO_YARN,  # YaRN ramp and cos/sin magnitude (rope_scaling)
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
    fn = driver.module("norm_rope").fn(kv_kernel("qk_rope_kv", k_cache))
    args = [ptr(q), ptr(k), ptr(v), i32(n), i32(H), i32(KVH), i32(hd), i32(vd), ptr(q_norm), ptr(k_norm), f32(eps),
            i32(rope_dim), f32(theta), f32(freq_scale), *_yarn_args(yarn), ptr(freq_factors),
            i32(1 if rope_neox else 0), ptr(pos), ptr(k_cache), ptr(v_cache)]  # fmt: skip
    return Launch(fn, ((H + KVH + 7) // 8, n), (256,), args)  # 8 heads a block


def mla_kv_rope(
    kva: DeviceArray,  # (n, R+P) f32: attn_kv_a_mqa rows [latent | k_pe]
    kv_norm: DeviceArray,  # (R,) f32: attn_kv_a_norm
    eps: float,
    q: DeviceArray,  # (n, H, nope+P) f32: per head [q_nope | q_pe]
    qa: DeviceArray,  # (n, H, R+P) f32: roped q_pe written to [..., R:]
    n: int, H: int, R: int, P: int, nope: int,
    theta: float, freq_scale: float,
    pos: DeviceArray,  # (1,) i32: position of token 0
    cache: DeviceArray,  # (max_seq, R+P) f32 or f16, this layer's latent rows
    *,
    yarn: Yarn = NO_YARN,
) -> Launch:  # fmt: skip
    """Cache row of each token: [RMSNorm(latent) * kv_norm | RoPE(k_pe)]; every head's q_pe roped into qa."""
    if n < 1 or H < 1 or R < 1 or nope < 0 or not (0 < P <= 256 and P % 2 == 0):
        raise CudaError(f"mla_kv_rope: n={n} H={H} R={R} nope={nope} need >= 1 (nope >= 0) and P={P} even, <= 256")
    D = R + P
    need(kva, "kva", "f4", n * D)
    need(kv_norm, "kv_norm", "f4", R)
    need(q, "q", "f4", n * H * (nope + P))
    need(qa, "qa", "f4", n * H * D)
    need(pos, "pos", "i4", 1)
    need_cache(cache, "cache", n * D)
    fn = driver.module("norm_rope").fn(kv_kernel("mla_kv_rope", cache))
    args = [ptr(kva), ptr(kv_norm), f32(eps), ptr(q), ptr(qa), i32(n), i32(H), i32(R), i32(P), i32(nope), f32(theta),
            f32(freq_scale), *_yarn_args(yarn), ptr(pos), ptr(cache)]  # fmt: skip
    return Launch(fn, (n,), (256,), args)
