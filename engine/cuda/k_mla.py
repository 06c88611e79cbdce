"""Launch wrappers for kernels/mla.cu: the per-head matvecs of multi-head latent attention (attn_k_b absorbing q_nope
into the latent space, attn_v_b decompressing the attention output) and the absorbed attention over the latent cache,
for one decode token (split over keys, then k_attention.attn_combine) or a causal chunk (contract: kernels/README.md).

Each function checks its buffers and returns a `driver.Launch` (it does not launch). Buffers may be larger than
needed; float buffers the kernels read as float4 must be 16-byte aligned (every row and head offset a multiple of 4).
"""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import Launch, f32, i32, i64, ptr
from engine.cuda.k_attention import kv_kernel, need_cache
from engine.cuda.memory import DeviceArray, DeviceWeight, need, need_aligned_weight
from engine.errors import CudaError
from engine.quants import BLOCK_SIZES, GGMLType

HEAD_MATVEC_THREADS = 128  # one weight row per thread
HEAD_MATVEC_MAX_K = 512  # K floats of N tokens staged in shared memory
HEAD_MATVEC_TOKENS = (1, 16)  # mla_head_matvec_*_n{N}: n == 1 uses N = 1, more tokens go 16 per block
HEAD_MATVEC_WARP_ROWS = 8  # mla_head_matvec_*_w: one token, a warp a row, 8 rows a block
ATTN_HEADS = 8  # heads per attention block (one warp each)
ATTN_THREADS = 256
MAX_LATENT = 512  # R, the value width
MAX_ROW = 640  # R + P, the latent row width


def head_matvec(
    w: DeviceWeight,  # (H * R, K) GGUF blocks: head h's (R, K) matrix is rows [h*R, h*R + R)
    H: int,  # heads
    x: DeviceArray,  # x of token t, head h: K floats at x_tok * t + x_head * h
    x_tok: int, x_head: int,  # float strides, multiples of 4
    n: int,  # tokens
    y: DeviceArray,  # y[t, h, r] at y_tok * t + y_head * h + r, r < R
    y_tok: int, y_head: int,
    warp: bool = True,  # one token: a warp a row (mla_head_matvec_{t}_w); False: the thread-a-row kernel
) -> Launch:  # fmt: skip
    """y[t, h, :] = W_h . x[t, h, :] for every head h and token t < n (the weights read in place, per head)."""
    K = w.cols
    if H < 1 or w.rows % H:
        raise CudaError(f"head_matvec {w.name}: {w.rows} rows do not split into {H} heads")
    R = w.rows // H
    block = BLOCK_SIZES[GGMLType(w.ggml_type)][0]
    if n < 1 or n > 65535 * HEAD_MATVEC_TOKENS[-1] or K > HEAD_MATVEC_MAX_K or K % block:
        raise CudaError(f"head_matvec {w.name}: n={n} tokens, K={K} must be whole {w.tag} blocks up to "
                        f"{HEAD_MATVEC_MAX_K}")  # fmt: skip
    if x_tok % 4 or x_head % 4 or x_head < K or x_tok < H * x_head or y_head < R or y_tok < H * y_head:
        raise CudaError(f"head_matvec {w.name}: strides x ({x_tok}, {x_head}) / y ({y_tok}, {y_head}) overlap heads "
                        "or break 16-byte alignment")  # fmt: skip
    need_aligned_weight(w)
    need(x, "x", "f4", (n - 1) * x_tok + (H - 1) * x_head + K, aligned=True)
    need(y, "y", "f4", (n - 1) * y_tok + (H - 1) * y_head + R)
    if n == 1 and warp:  # a warp a row: R * H warps instead of R * H threads
        fn = driver.module("mla").fn(f"mla_head_matvec_{w.tag}_w")
        args = [ptr(w.ptr), i64(w.row_bytes), i32(R), i32(K), ptr(x), i32(x_head), ptr(y), i32(y_head)]
        return Launch(fn, ((R + HEAD_MATVEC_WARP_ROWS - 1) // HEAD_MATVEC_WARP_ROWS, H), (32 * HEAD_MATVEC_WARP_ROWS,),
                      args)  # fmt: skip
    big_n = 1 if n == 1 else HEAD_MATVEC_TOKENS[-1]
    fn = driver.module("mla").fn(f"mla_head_matvec_{w.tag}_n{big_n}")
    args = [ptr(w.ptr), i64(w.row_bytes), i32(R), i32(K), ptr(x), i64(x_tok), i32(x_head), i32(n), ptr(y),
            i64(y_tok), i32(y_head)]  # fmt: skip
    grid = ((R + HEAD_MATVEC_THREADS - 1) // HEAD_MATVEC_THREADS, H, (n + big_n - 1) // big_n)
    return Launch(fn, grid, (HEAD_MATVEC_THREADS,), args)


def attn(
    qa: DeviceArray,  # (n, H, R+P) f32: absorbed queries of tokens at *pos .. *pos+n-1
    cache: DeviceArray,  # (max_seq, R+P) f32 or f16: this layer's latent rows, 0 .. *pos+n-1 written
    pos: DeviceArray,  # (1,) i32
    n: int, H: int, R: int, P: int, scale: float,
    n_splits: int,  # 1: `out` gets the result; > 1: partials for k_attention.attn_combine over n*H rows
    part_o: DeviceArray | None,  # (n, H, n_splits, R) f32 out (n_splits > 1)
    part_ml: DeviceArray | None,  # (n, H, n_splits, 2) f32 out (n_splits > 1)
    out: DeviceArray | None,  # (n, H, R) f32 out (n_splits == 1)
) -> Launch:  # fmt: skip
    """Causal absorbed attention: o[t, h] = softmax_j(qa[t, h] . row_j * scale) . row_j[:R] over j <= *pos + t."""
    D = R + P
    if not (0 < R <= MAX_LATENT and R % 4 == 0 and P >= 0 and P % 4 == 0 and D <= MAX_ROW):
        raise CudaError(f"mla attn: latent {R} + rope {P} must be multiples of 4, R <= {MAX_LATENT}, R+P <= {MAX_ROW}")
    if not (1 <= n <= 65535 and H >= 1 and n_splits >= 1):
        raise CudaError(f"mla attn: n={n} (<= 65535), H={H}, n_splits={n_splits} must be >= 1")
    need(qa, "qa", "f4", n * H * D, aligned=True)
    need_cache(cache, "cache", n * D)
    need(pos, "pos", "i4", 1)
    if n_splits == 1:
        need(out, "out", "f4", n * H * R, aligned=True)
    else:
        need(part_o, "part_o", "f4", n * H * n_splits * R, aligned=True)
        need(part_ml, "part_ml", "f4", n * H * n_splits * 2)
    fn = driver.module("mla").fn(kv_kernel("mla_attn", cache))
    args = [ptr(qa), ptr(cache), ptr(pos), i32(H), i32(R), i32(D), f32(scale), i32(n_splits),
            ptr(part_o if n_splits > 1 else None), ptr(part_ml if n_splits > 1 else None),
            ptr(out if n_splits == 1 else None)]  # fmt: skip
    return Launch(fn, ((H + ATTN_HEADS - 1) // ATTN_HEADS, n_splits, n), (ATTN_THREADS,), args)
