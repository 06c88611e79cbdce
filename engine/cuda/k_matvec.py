"""Launch wrappers for kernels/matvec.cu: decode and small-batch matvecs (fused RMSNorm, residual, SwiGLU) and gathered
row dots (the LM head for system1).

Each function checks its buffers and returns a `driver.Launch` (it does not launch). Names, argument order, grid and
block follow kernels/README.md. Buffers may be larger than needed. Float buffers read as float4 (x, norm_w) and
weights must be 16-byte aligned (cudaMalloc'd arrays and GGUF tensor offsets are).
"""

from __future__ import annotations

from engine.cuda import dispatch, driver
from engine.cuda.driver import Launch, f32, i32, i64, ptr
from engine.cuda.memory import DeviceArray, DeviceWeight, need, need_aligned_weight, need_same_layout
from engine.errors import CudaError
from engine.quants import KERNEL_TAGS, LOWBIT_TYPES, GGMLType

ROWS_PER_BLOCK = 8  # matvec: 8 warps, 8 output rows per block; gather_dot: one output per warp
THREADS = 256
TOKEN_BUCKETS = (1, 2, 4, 8)  # matvec_*_n{N} variants; a launch of n tokens uses the smallest N >= n
LOWBIT_BUCKETS = (1, 8)  # the variants built for quants.LOWBIT_TYPES (kernels/matvec.cu)
# matvec_stream_{t} (kernels/matvec_stream.cuh): 4 warps a block, 16 rows a warp; the quantized common types
STREAM_TYPES = frozenset(
    {GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K,
     GGMLType.Q6_K}
)  # fmt: skip
STREAM_THREADS, STREAM_ROWS_PER_BLOCK = 128, 64
# matvec_stream16_{t}: x rounded to 16 bits and dotted in integers (kernels/quant_i16.cuh); dispatch.stream_i16 decides
STREAM16_TYPES = frozenset({GGMLType.Q6_K, GGMLType.Q8_0})
# matvec16_{t}_n1, matvec_swiglu16_{t}_n1, matvec3_16_{t}_n1 (and _q4_k_q6_k): the 1-token kernels with x rounded to
# 16 bits (kernels/quant_i16.cuh's types); dispatch.matvec_i16 decides
I16_TYPES = frozenset({GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_0})


# matvec3_{a}_{b}_n1 (kernels/matvec.cu): the first two matrices of type a, the third of type b
MATVEC3_PAIRS = frozenset(
    {(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.Q5_K, GGMLType.Q6_K), (GGMLType.Q4_K, GGMLType.Q5_K)}
)


def has_matvec3(ggml_type: int) -> bool:
    """Whether kernels/matvec.cu builds matvec3 for this type (the common types, not quants.LOWBIT_TYPES)."""
    return ggml_type in KERNEL_TAGS and ggml_type not in LOWBIT_TYPES


def matvec3_order(types: list[int]) -> list[int] | None:
    """The order in which matrices of these types (one token, one width) go through one matvec3 launch: all of one
    type in any order, or two of a and one of b for (a, b) in MATVEC3_PAIRS with b last; None when no launch takes
    them."""
    if not 1 <= len(types) <= 3 or not all(has_matvec3(t) for t in types):
        return None
    if len(set(types)) == 1:
        return list(range(len(types)))
    for a, b in MATVEC3_PAIRS:
        if len(types) == 3 and types.count(a) == 2 and types.count(b) == 1:
            return sorted(range(3), key=lambda i: types[i] == b)
    return None


def takes_stream(w: DeviceWeight, n: int) -> bool:
    """Whether `matvec` of n tokens through w takes matvec_stream by its own choice (a type with the kernel, and
    dispatch.use_stream's shape)."""
    return w.ggml_type in STREAM_TYPES and dispatch.use_stream(w.rows, w.cols, n)


def _bucket(n: int, ggml_type: int) -> int:
    for b in LOWBIT_BUCKETS if ggml_type in LOWBIT_TYPES else TOKEN_BUCKETS:
        if 1 <= n <= b:
            return b
    raise CudaError(f"matvec takes 1 to {TOKEN_BUCKETS[-1]} tokens, got {n}")


def _i16(n: int, types: list[int]) -> str:
    """The name's mark of the 16-bit form ("16") where a 1-token launch over these types takes it, else ""."""
    return "16" if n == 1 and all(t in I16_TYPES for t in types) and dispatch.matvec_i16() else ""


def _blocks(count: int, per_block: int) -> int:
    return (count + per_block - 1) // per_block


def matvec(
    w: DeviceWeight,  # (R, K) GGUF blocks
    x: DeviceArray,  # (n, K) f4
    n: int,  # tokens, 1..8
    y: DeviceArray,  # (n, R) f4; y = resid + w . rmsnorm(x)
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4: RMS-normalise x first (per token), times norm_w
    eps: float = 0.0,
    resid: DeviceArray | None = None,  # (n, R) f4, may be y itself
    stream: bool | None = None,  # matvec_stream (n = 1, K <= 2048, STREAM_TYPES); None: dispatch.use_stream decides
    best: DeviceArray | None = None,  # (1,) u8 holding 0: matvec_stream folds y's argmax key in (k_sample.argmax_key)
) -> Launch:
    big_n = _bucket(n, w.ggml_type)
    need_aligned_weight(w)
    need(x, "x", "f4", n * w.cols, aligned=True)
    need(y, "y", "f4", n * w.rows)
    if norm_w is not None:
        need(norm_w, "norm_w", "f4", w.cols, aligned=True)
    if resid is not None:
        need(resid, "resid", "f4", n * w.rows)
    if stream is None:
        stream = takes_stream(w, n)
    if best is not None:
        need(best, "best", "u8", 1)
        if not stream:
            raise CudaError("only matvec_stream folds an argmax key (best)")
    if stream:
        if w.ggml_type not in STREAM_TYPES or n != 1 or w.cols > dispatch.STREAM_MAX_K:
            raise CudaError(f"matvec_stream takes 1 token, K <= {dispatch.STREAM_MAX_K}, a quantized common type")
        # _k1024: half the x registers, twice the warps an SM (dispatch.STREAM_NARROW_K)
        suffix = "_k1024" if w.cols <= dispatch.STREAM_NARROW_K else ""
        form = "stream16" if w.ggml_type in STREAM16_TYPES and dispatch.stream_i16() else "stream"
        fn = driver.module("matvec").fn(f"matvec_{form}_{w.tag}{suffix}")
        args = [ptr(w.ptr), i64(w.row_bytes), i32(w.rows), i32(w.cols), ptr(x), ptr(norm_w), f32(eps), ptr(resid),
                ptr(y), ptr(best)]  # fmt: skip
        return Launch(fn, (_blocks(w.rows, STREAM_ROWS_PER_BLOCK),), (STREAM_THREADS,), args)
    fn = driver.module("matvec").fn(f"matvec{_i16(big_n, [w.ggml_type])}_{w.tag}_n{big_n}")
    args = [ptr(w.ptr), i64(w.row_bytes), i32(w.rows), i32(w.cols), ptr(x), i32(n), ptr(norm_w), f32(eps), ptr(resid),
            ptr(y)]  # fmt: skip
    return Launch(fn, (_blocks(w.rows, ROWS_PER_BLOCK),), (THREADS,), args)


def matvec3(
    ws: list[DeviceWeight],  # 1 to 3 matrices (R_m, K) of one width, in an order matvec3_order keeps
    x: DeviceArray,  # (1, K) f4: one token
    ys: list[DeviceArray],  # (1, R_m) f4 each; ys[m] = ws[m] . rmsnorm(x)
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4
    eps: float = 0.0,
) -> Launch:
    """One launch for the matvecs of one token through matrices that read the same x (q/k/v): results equal to
    one `matvec` launch each, bit for bit."""
    tags, weights, outs, blocks = matvec3_operands("matvec3", ws, ys, ROWS_PER_BLOCK)
    need(x, "x", "f4", ws[0].cols, aligned=True)
    if norm_w is not None:
        need(norm_w, "norm_w", "f4", ws[0].cols, aligned=True)
    for w, y in zip(ws, ys, strict=True):
        need_aligned_weight(w)
        need(y, "y", "f4", w.rows)
    fn = driver.module("matvec").fn(f"matvec3{'_16' if _i16(1, [w.ggml_type for w in ws]) else ''}_{tags}_n1")
    return Launch(fn, (blocks,), (THREADS,), [*weights, i32(ws[0].cols), ptr(x), ptr(norm_w), f32(eps), *outs])


def matvec3_operands(kernel: str, ws: list[DeviceWeight], ys: list[DeviceArray],
                     per_block: int) -> tuple[str, list, list, int]:  # fmt: skip
    """Up to three matrices of one width for one launch (matvec3, tc_matvec's tcmv3), checked (matvec3_order) and
    packed: the type tag of the kernel's name, the weight arguments (pointers, row bytes, rows; padded to three, a
    missing matrix has no rows), the outputs' pointers, and the grid's blocks of `per_block` rows."""
    if not 1 <= len(ws) <= 3 or len(ys) != len(ws):
        raise CudaError(f"{kernel} takes 1 to 3 matrices and as many outputs, got {len(ws)} and {len(ys)}")
    w0, types = ws[0], [w.ggml_type for w in ws]
    if any(w.cols != w0.cols for w in ws) or matvec3_order(types) != list(range(len(ws))):
        got = ", ".join(f"{w.name} {w.tag} x{w.cols}" for w in ws)
        raise CudaError(f"{kernel} takes matrices of one width, of one type or two of a and one of b (b last) for "
                        f"(a, b) in MATVEC3_PAIRS, got {got}")  # fmt: skip
    pad = 3 - len(ws)
    rows = [w.rows for w in ws] + [0] * pad
    weights = [*(ptr(w.ptr) for w in ws + [w0] * pad), *(i64(w.row_bytes) for w in ws + [w0] * pad),
               *(i32(r) for r in rows)]  # fmt: skip
    tags = w0.tag if len(set(types)) == 1 else f"{w0.tag}_{ws[2].tag}"
    return tags, weights, [ptr(y) for y in [*ys] + [ys[0]] * pad], sum(_blocks(r, per_block) for r in rows)


def matvec_swiglu(
    wg: DeviceWeight,  # (R, K) GGUF blocks: ffn_gate
    wu: DeviceWeight,  # (R, K) same type: ffn_up
    x: DeviceArray,  # (n, K) f4
    n: int,  # tokens, 1..8
    y: DeviceArray,  # (n, R) f4; y = silu(wg . xn) * (wu . xn), xn = rmsnorm(x) or x
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4
    eps: float = 0.0,
) -> Launch:
    need_same_layout(wg, wu, "swiglu")
    big_n = _bucket(n, wg.ggml_type)
    need(x, "x", "f4", n * wg.cols, aligned=True)
    need(y, "y", "f4", n * wg.rows)
    if norm_w is not None:
        need(norm_w, "norm_w", "f4", wg.cols, aligned=True)
    fn = driver.module("matvec").fn(f"matvec_swiglu{_i16(big_n, [wg.ggml_type])}_{wg.tag}_n{big_n}")
    args = [ptr(wg.ptr), ptr(wu.ptr), i64(wg.row_bytes), i32(wg.rows), i32(wg.cols), ptr(x), i32(n), ptr(norm_w),
            f32(eps), ptr(y)]  # fmt: skip
    return Launch(fn, (_blocks(wg.rows, ROWS_PER_BLOCK),), (THREADS,), args)


def gather_dot(
    w: DeviceWeight,  # (R, K) GGUF blocks
    x: DeviceArray,  # activations: output i uses x[i * x_stride : i * x_stride + K] f4
    x_stride: int,  # floats between outputs' activations; 0: one x for all; a multiple of 4 (16-byte aligned)
    rows: DeviceArray,  # (n,) i4, each in [0, R) (not checked: device memory)
    n: int,  # outputs
    out: DeviceArray,  # (n,) f4; out[i] = dot(w[rows[i]], x_i)
) -> Launch:
    if n < 1 or x_stride < 0 or x_stride % 4:
        raise CudaError(f"gather_dot: n={n} must be >= 1 and x_stride={x_stride} a non-negative multiple of 4")
    need_aligned_weight(w)
    need(x, "x", "f4", (n - 1) * x_stride + w.cols, aligned=True)
    need(rows, "rows", "i4", n)
    need(out, "out", "f4", n)
    fn = driver.module("matvec").fn(f"gather_dot_{w.tag}")
    args = [ptr(w.ptr), i64(w.row_bytes), i32(w.cols), ptr(x), i64(x_stride), ptr(rows), i32(n), ptr(out)]
    return Launch(fn, (_blocks(n, ROWS_PER_BLOCK),), (THREADS,), args)
