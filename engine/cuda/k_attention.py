"""Launch wrappers for kernels/attention.cu: split-key decode attention, its combine, causal prefill attention
(contract: kernels/README.md).

Each function checks its buffers and returns a `driver.Launch` (it does not launch). Buffers may be larger than
needed; float buffers the kernels read as float4 (q, the KV cache) must be 16-byte aligned, with hd and vd multiples
of 4. Positions are in device memory (`pos`, one int32), so a launch built once serves every step of a graph.
The K/V cache is float32 ("f4") or float16 ("f2", KV_CACHE_TYPE=f16: 8-byte aligned); each kernel that touches it
has an entry point per element (`kv_kernel`).
"""

from __future__ import annotations

from engine.cuda import dispatch, driver
from engine.cuda.driver import Launch, f32, i32, ptr
from engine.cuda.memory import DeviceArray, need
from engine.errors import CudaError

MAX_HEAD_DIM = 256  # hd and vd; rope_dim / 2 <= 128 cos/sin pairs in shared memory
MAX_COMBINE_SPLITS = 64  # attn_combine's weights in shared memory
FOLD_FLOATS = 4 * 32 * 8 + 4 * 8 * 128 + 4 * 8 * 2  # attn_decode's shared floats: the folded combine's weights' room


def _heads(H: int, KVH: int, hd: int, vd: int) -> None:
    if H < 1 or KVH < 1 or H % KVH:
        raise CudaError(f"attention: {H} q heads cannot share {KVH} kv heads")
    if not (0 < hd <= MAX_HEAD_DIM and 0 < vd <= MAX_HEAD_DIM and hd % 4 == 0 and vd % 4 == 0):
        raise CudaError(f"attention: head dims {hd}/{vd} must be multiples of 4 up to {MAX_HEAD_DIM}")


KV_ALIGN = {"f4": 16, "f2": 8}  # the cache's element -> the alignment its four-value loads need


def kv_kernel(name: str, cache: DeviceArray) -> str:
    """The entry point of kernel `name` for the cache's element: `name` over float32, `name`_f16 over float16."""
    return name if cache.dtype == "f4" else name + "_f16"


def need_cache(cache: DeviceArray | None, name: str, n: int, dtype: str | None = None) -> None:
    """A K/V (or latent) cache of at least n elements of "f4" or "f2" (`dtype` when given), aligned for its loads."""
    if cache is None:
        raise CudaError(f"{name}: missing")
    if cache.dtype not in KV_ALIGN or (dtype is not None and cache.dtype != dtype):
        raise CudaError(f"{name}: a cache of {dtype or 'f4 or f2'} elements, got {cache.dtype}")
    need(cache, name, cache.dtype, n)
    if cache.ptr % KV_ALIGN[cache.dtype]:
        raise CudaError(f"{name}: address {cache.ptr:#x} is not {KV_ALIGN[cache.dtype]}-byte aligned")


def _cache(k_cache: DeviceArray, v_cache: DeviceArray, rows: int, KVH: int, hd: int, vd: int) -> None:
    # (max_seq, KVH, hd) and (max_seq, KVH, vd) of one layer, one element type; `rows` positions at least
    need_cache(k_cache, "k_cache", rows * KVH * hd)
    need_cache(v_cache, "v_cache", rows * KVH * vd, k_cache.dtype)


def attn_decode(
    q: DeviceArray,  # (n, H*hd) f32: tokens at positions *pos .. *pos+n-1
    k_cache: DeviceArray, v_cache: DeviceArray,  # this layer's, keys 0..*pos+n-1 written
    pos: DeviceArray,  # (1,) i32
    H: int, KVH: int, hd: int, vd: int, scale: float,
    n_splits: int,  # key splits: a fixed grid for every length (32..64 keep 4k keys flat-cost)
    part_o: DeviceArray,  # (n*H, n_splits, vd) f32: partial outputs
    part_ml: DeviceArray,  # (n*H, n_splits, 2) f32: their max and sum
    counters: DeviceArray | None = None,  # (n*KVH*parts,) i32, zero before the first launch (each launch leaves so)
    out: DeviceArray | None = None,  # (n, H*vd) f32 out, with counters
    min_chunk: int = 1,  # keys a split at least
    parts: int = 1,  # blocks sharing a kv head's q heads (a whole divisor of H / KVH)
    prefetch: bool | None = None,  # each block's cache rows into L2 before its wait; None: dispatch.prefetch_keys()
    n: int = 1,  # tokens, each attending causally to keys 0..its position
    warps: int | None = None,  # a block's: 4, or 8 (attn_decode_w8); None: dispatch.decode_warps
) -> Launch:  # fmt: skip
    """With counters and out: one launch, the splits combined by the last block of each row of blocks; without: the
    partials, for attn_combine over n*H heads (kernels/README.md; dispatch.decode_attention chooses)."""
    if prefetch is None:
        prefetch = dispatch.prefetch_keys()
    _heads(H, KVH, hd, vd)
    if n_splits < 1 or min_chunk < 1:
        raise CudaError(f"attn_decode: n_splits {n_splits} and min_chunk {min_chunk} must be >= 1")
    if parts < 1 or (H // KVH) % parts:
        raise CudaError(f"attn_decode: {H // KVH} q heads a kv head cannot go in {parts} equal parts")
    if (counters is None) != (out is None):
        raise CudaError("attn_decode: counters and out come together (the folded combine)")
    if counters is not None and H // KVH // parts * (n_splits + 1) > FOLD_FLOATS:
        raise CudaError(f"attn_decode: the folded combine's weights of {H // KVH // parts} heads x {n_splits} splits "
                        f"exceed its {FOLD_FLOATS} floats of shared memory")  # fmt: skip
    if n < 1 or n * H * max(hd, n_splits * vd) >= 2**31:  # the kernel offsets a token's rows in 32-bit integers
        raise CudaError(f"attn_decode: {n} tokens of {H} heads x {n_splits} splits do not fit its offsets")
    need(q, "q", "f4", n * H * hd, aligned=True)
    need(pos, "pos", "i4", 1)
    _cache(k_cache, v_cache, n, KVH, hd, vd)
    need(part_o, "part_o", "f4", n * H * n_splits * vd)
    need(part_ml, "part_ml", "f4", n * H * n_splits * 2)
    if counters is not None:
        need(counters, "counters", "i4", n * KVH * parts)
        need(out, "out", "f4", n * H * vd)
    G = H // KVH // parts
    if warps is None:
        warps = dispatch.decode_warps(G, hd, vd)
    if warps not in dispatch.DECODE_WAVE_BLOCKS or (warps == 8 and not dispatch.w8_takes(G, hd, vd)):
        raise CudaError(f"attn_decode: {warps} warps a block for {G} q heads of {hd}/{vd} dims (8: at most 4 of 128)")
    fn = driver.module("attention").fn(kv_kernel("attn_decode" if warps == 4 else "attn_decode_w8", k_cache))
    args = [ptr(q), ptr(k_cache), ptr(v_cache), ptr(pos), i32(H), i32(KVH), i32(hd), i32(vd), f32(scale),
            i32(n_splits), i32(min_chunk), i32(parts), ptr(part_o), ptr(part_ml), ptr(counters), ptr(out),
            i32(1 if prefetch else 0)]  # fmt: skip
    return Launch(fn, (KVH * parts, n_splits, n), (32 * warps,), args)


def decode_launches(q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, pos: DeviceArray, H: int, KVH: int,
                    hd: int, vd: int, scale: float, part_o: DeviceArray, part_ml: DeviceArray, counters: DeviceArray,
                    out: DeviceArray, n: int = 1) -> list[Launch]:  # fmt: skip
    """The attention of n tokens (n = 1: a decode step) into out (n, H*vd) f32, folded or with attn_combine as
    dispatch.decode_attention picks for the head grouping. part_o (H, S, vd) and part_ml (H, S, 2) are the model's
    (S = dispatch.decode_splits); n tokens take S // n splits each, so they fit the same buffers (n <= S). counters
    as attn_decode takes them, n * H of them."""
    fold, min_chunk, parts = dispatch.decode_attention(H, KVH)
    splits = part_o.shape[1] // n
    if splits < 1:
        raise CudaError(f"attn_decode: {n} tokens over partials of {part_o.shape[1]} splits")
    part_o = part_o.view(0, (n * H, splits, vd))
    part_ml = part_ml.view(0, (n * H, splits, 2))
    if fold:
        return [attn_decode(q, k_cache, v_cache, pos, H, KVH, hd, vd, scale, splits, part_o, part_ml, counters, out,
                            min_chunk=min_chunk, parts=parts, n=n)]  # fmt: skip
    return [attn_decode(q, k_cache, v_cache, pos, H, KVH, hd, vd, scale, splits, part_o, part_ml, min_chunk=min_chunk,
                        parts=parts, n=n),
            attn_combine(part_o, part_ml, n * H, splits, vd, out)]  # fmt: skip


def attention_launches(q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, pos: DeviceArray, n: int, H: int,
                       KVH: int, hd: int, vd: int, scale: float, part_o: DeviceArray, part_ml: DeviceArray,
                       counters: DeviceArray, out: DeviceArray) -> list[Launch]:  # fmt: skip
    """The causal attention of n tokens at positions *pos.. into out (n, H*vd): decode_launches while
    dispatch.decode_tokens takes n (the buffers as there), else one attn_prefill launch."""
    if dispatch.decode_tokens(n, part_o.shape[1]):
        return decode_launches(q, k_cache, v_cache, pos, H, KVH, hd, vd, scale, part_o, part_ml, counters, out, n)
    tc = dispatch.prefill_tc(hd, vd, driver.compute_major())
    return [attn_prefill(q, k_cache, v_cache, pos, n, H, KVH, hd, vd, scale, out, tc=tc)]


def decode_buffers(H: int, KVH: int, vd: int, hd: int) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
    """A model's scratch for decode_launches, H q heads over KVH kv heads of hd / vd dims: part_o (H, S, vd) f32,
    part_ml (H, S, 2) f32 (S = dispatch.decode_splits) and the tickets of dispatch.DECODE_TOKENS tokens (16 H,) i32,
    zeroed (enough for any parts: KVH x parts <= H)."""
    splits = dispatch.decode_splits(H, KVH, vd, hd)
    part_o = DeviceArray.empty((H, splits, vd))
    part_ml = DeviceArray.empty((H, splits, 2))
    return part_o, part_ml, split_counters(dispatch.DECODE_TOKENS * H)


def split_counters(rows: int) -> DeviceArray:
    """attn_decode's tickets, one a row of blocks and token (KVH x parts x tokens; a model holds
    dispatch.DECODE_TOKENS x H, enough for any parts): (rows,) i32, zeroed."""
    c = DeviceArray.empty((rows,), "i4")
    c.fill_byte(0)
    return c


def attn_combine(part_o: DeviceArray, part_ml: DeviceArray, H: int, n_splits: int, vd: int, out: DeviceArray) -> Launch:
    """out (H*vd,) f32 from split-key partials: part_o (H, n_splits, vd), part_ml (H, n_splits, 2) f32 (MLA's)."""
    if not 1 <= n_splits <= MAX_COMBINE_SPLITS:
        raise CudaError(f"attn_combine: {n_splits} splits, at most {MAX_COMBINE_SPLITS}")
    need(part_o, "part_o", "f4", H * n_splits * vd)
    need(part_ml, "part_ml", "f4", H * n_splits * 2)
    need(out, "out", "f4", H * vd)
    fn = driver.module("attention").fn("attn_combine")
    return Launch(fn, (H, (vd + 127) // 128), (128,), [ptr(part_o), ptr(part_ml), i32(H), i32(n_splits), i32(vd),
                                                       ptr(out)])  # fmt: skip


def prefill_smem_bytes(hd: int, vd: int) -> int:
    """attn_prefill's dynamic shared memory: q and k tiles [32][hd+4], v tile [32][vd], P [4][32][8], 32 floats."""
    return 4 * (2 * 32 * (hd + 4) + 32 * vd + 4 * 256 + 32)


def prefill_tc_smem_bytes(hd: int, vd: int) -> int:
    """attn_prefill_tc's dynamic shared memory: q [64][hd+4], k [32][hd+4], v [32][vd+4] floats."""
    return 4 * (64 * (hd + 4) + 32 * (hd + 4) + 32 * (vd + 4))


def attn_prefill(
    q: DeviceArray,  # (n, H*hd) f32: tokens at positions *pos .. *pos+n-1
    k_cache: DeviceArray, v_cache: DeviceArray,  # this layer's, keys 0..*pos+n-1 written
    pos: DeviceArray,  # (1,) i32
    n: int, H: int, KVH: int, hd: int, vd: int, scale: float,
    out: DeviceArray,  # (n, H*vd) f32
    tc: bool = False,  # attn_prefill_tc: on tensor cores (sm_80 and later), hd = vd in dispatch.PREFILL_TC_DIMS
    key_groups: int | None = None,  # attn_prefill_tc's, 1 or 2; default dispatch.prefill_tc_key_groups()
) -> Launch:  # fmt: skip
    _heads(H, KVH, hd, vd)
    if tc and (hd != vd or hd not in dispatch.PREFILL_TC_DIMS):
        raise CudaError(f"attn_prefill_tc: head dims {hd}/{vd}, it takes equal ones in {dispatch.PREFILL_TC_DIMS}")
    if tc and driver.compute_major() < 8:
        raise CudaError("attn_prefill_tc: tf32 tensor cores need sm_80 or later")
    need(q, "q", "f4", n * H * hd, aligned=True)
    need(pos, "pos", "i4", 1)
    _cache(k_cache, v_cache, n, KVH, hd, vd)
    need(out, "out", "f4", n * H * vd, aligned=True)
    groups = 1
    if tc:
        groups = dispatch.prefill_tc_key_groups() if key_groups is None else key_groups
        if groups not in dispatch.PREFILL_TC_KEY_GROUPS:
            raise CudaError(f"attn_prefill_tc: key groups {groups}, one of {dispatch.PREFILL_TC_KEY_GROUPS}")
    name, queries = (f"attn_prefill_tc{hd}{'_k2' if groups == 2 else ''}", 64) if tc else ("attn_prefill", 32)
    smem = prefill_tc_smem_bytes(hd, vd) if tc else prefill_smem_bytes(hd, vd)
    fn = driver.module("attention").fn(kv_kernel(name, k_cache))
    driver.allow_smem(fn, smem)
    args = [ptr(q), ptr(k_cache), ptr(v_cache), ptr(pos), i32(n), i32(H), i32(KVH), i32(hd), i32(vd), f32(scale),
            ptr(out)]  # fmt: skip
    return Launch(fn, ((n + queries - 1) // queries, H), (128 * groups,), args, smem=smem)
