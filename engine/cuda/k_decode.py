"""One decode token's attention from its raw projections: QK-norm, RoPE, the K/V cache write, then split-key attention.
Folded into one launch (attention.cu's `attn_decode_rope`) where dispatch.rope_in_attention allows it, else
norm_rope.cu's `qk_rope_kv` then k_attention.decode_launches. Both give the same bits (kernels/rope.cuh); the folded
form leaves q raw."""

from __future__ import annotations

import os

from engine.cuda import dispatch, driver
from engine.cuda import k_attention as ka
from engine.cuda import k_norm_rope as knr
from engine.cuda.driver import Launch, f32, i32, ptr
from engine.cuda.memory import DeviceArray, need
from engine.errors import CudaError


def attn_decode_rope(
    q: DeviceArray, k: DeviceArray, v: DeviceArray,  # (H*hd,) (KVH*hd,) (KVH*vd,) f32: the token's projections
    q_norm: DeviceArray | None, k_norm: DeviceArray | None, eps: float,  # (hd,) f32 each, or None
    rope_dim: int, theta: float, freq_scale: float,
    freq_factors: DeviceArray | None,  # (rope_dim/2,) f32 or None
    rope_neox: bool,
    k_cache: DeviceArray, v_cache: DeviceArray,  # this layer's (max_seq, KVH, hd|vd) f32: row *pos written here
    pos: DeviceArray,  # (1,) i32
    H: int, KVH: int, hd: int, vd: int, scale: float,
    n_splits: int, part_o: DeviceArray, part_ml: DeviceArray,  # as k_attention.attn_decode takes them
    counters: DeviceArray | None = None, out: DeviceArray | None = None,
    min_chunk: int = 1,
    *,
    yarn: knr.Yarn = knr.NO_YARN,
) -> Launch:  # fmt: skip
    """One launch: qk_rope_kv's preamble for the token at *pos, then k_attention.attn_decode's split attention."""
    ka._heads(H, KVH, hd, vd)
    if H // KVH * hd > dispatch.ROPE_MAX_GQ:
        raise CudaError(f"attn_decode_rope: {H // KVH} q heads of {hd} a kv head exceed {dispatch.ROPE_MAX_GQ} values")
    if not (0 < rope_dim <= hd and rope_dim % 2 == 0):
        raise CudaError(f"attn_decode_rope: rope_dim {rope_dim} must be even and within head_dim {hd}")
    if n_splits < 1 or min_chunk < 1:
        raise CudaError(f"attn_decode_rope: n_splits {n_splits} and min_chunk {min_chunk} must be >= 1")
    if (counters is None) != (out is None):
        raise CudaError("attn_decode_rope: counters and out come together (the folded combine)")
    need(q, "q", "f4", H * hd)
    need(k, "k", "f4", KVH * hd)
    need(v, "v", "f4", KVH * vd)
    optional = ((q_norm, "q_norm", hd), (k_norm, "k_norm", hd), (freq_factors, "freq_factors", rope_dim // 2))
    for a, name, size in optional:
        if a is not None:
            need(a, name, "f4", size)
    need(pos, "pos", "i4", 1)
    ka._cache(k_cache, v_cache, 1, KVH, hd, vd)
    need(part_o, "part_o", "f4", H * n_splits * vd)
    need(part_ml, "part_ml", "f4", H * n_splits * 2)
    if counters is not None:
        need(counters, "counters", "i4", KVH)
        need(out, "out", "f4", H * vd)
    fn = driver.module("attention").fn("attn_decode_rope")
    args = [ptr(q), ptr(k), ptr(v), ptr(q_norm), ptr(k_norm), f32(eps), i32(rope_dim), f32(theta), f32(freq_scale),
            *knr.yarn_args(yarn), ptr(freq_factors), i32(1 if rope_neox else 0), ptr(k_cache), ptr(v_cache),
            ptr(pos), i32(H), i32(KVH), i32(hd), i32(vd), f32(scale), i32(n_splits), i32(min_chunk), ptr(part_o),
            ptr(part_ml), ptr(counters), ptr(out)]  # fmt: skip
    return Launch(fn, (KVH, n_splits), (128,), args)


def folds_rope() -> bool:
    """Whether decode takes the folded form where its shape allows (REFLEX_ROPE_FOLD=0: the two-launch form)."""
    return os.environ.get("REFLEX_ROPE_FOLD", "1") != "0"


def decode_rope_launches(
    q: DeviceArray, k: DeviceArray, v: DeviceArray,
    q_norm: DeviceArray | None, k_norm: DeviceArray | None, eps: float,
    rope_dim: int, theta: float, freq_scale: float, freq_factors: DeviceArray | None, rope_neox: bool,
    k_cache: DeviceArray, v_cache: DeviceArray, pos: DeviceArray,
    H: int, KVH: int, hd: int, vd: int, scale: float,
    part_o: DeviceArray, part_ml: DeviceArray, counters: DeviceArray, out: DeviceArray,
    *,
    yarn: knr.Yarn = knr.NO_YARN,
    fold: bool | None = None,  # None: folds_rope() and the shape decide
) -> list[Launch]:  # fmt: skip
    """The token at *pos into out (H*vd,) f32: attn_decode_rope (folded or split as dispatch.decode_attention picks),
    or qk_rope_kv + k_attention.decode_launches where dispatch.rope_in_attention refuses the shape."""
    if fold is None:
        fold = folds_rope() and dispatch.rope_in_attention(H, KVH, hd)
    if not fold:
        return [knr.qk_rope_kv(q, k, v, 1, H, KVH, hd, vd, q_norm, k_norm, eps, rope_dim, theta, freq_scale,
                               freq_factors, rope_neox, pos, k_cache, v_cache, yarn=yarn),
                *ka.decode_launches(q, k_cache, v_cache, pos, H, KVH, hd, vd, scale, part_o, part_ml, counters,
                                    out)]  # fmt: skip
    folded, min_chunk = dispatch.decode_attention(H, KVH)
    n = dispatch.N_SPLITS
    rope = (q, k, v, q_norm, k_norm, eps, rope_dim, theta, freq_scale, freq_factors, rope_neox, k_cache, v_cache, pos,
            H, KVH, hd, vd, scale, n, part_o, part_ml)  # fmt: skip
    if folded:
        return [attn_decode_rope(*rope, counters, out, min_chunk, yarn=yarn)]
    return [attn_decode_rope(*rope, min_chunk=min_chunk, yarn=yarn), ka.attn_combine(part_o, part_ml, H, n, vd, out)]
