"""Launch wrappers for kernels/tc_matvec.cu: small-batch matmuls (up to 64 tokens, one weight read) on tensor cores,
with operands split into two f16 halves so the sums agree with the float32 matvec (fused RMSNorm, residual, SwiGLU).

Each function checks its buffers and returns a `driver.Launch` (it does not launch). Names, argument order, grid and
block follow kernels/README.md. Buffers may be larger than needed. x and norm_w are read as float4 and weights as
16-byte granules, so both must be 16-byte aligned (cudaMalloc'd arrays and GGUF tensor offsets are).
"""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import Launch, f32, i32, i64, ptr
from engine.cuda.k_matvec import matvec3_operands
from engine.cuda.memory import DeviceArray, DeviceWeight, need, need_aligned_weight, need_same_layout
from engine.errors import CudaError
from engine.quants import GGMLType

FRAGMENT_ROWS = 8  # rows of one mma weight fragment
WARPS_WIDE = 8  # warps a block of tcmv_swiglu / tcmv3; they split K (kernels/tc_matvec.cu)
ONE_THREADS = (1024, 512)  # tcmv's block: 32 warps at 16 tokens (16 in that A/B form, TCMV_ONE16), 16 at 32 and 64
TOKEN_TILES = (16, 32, 64)  # tcmv_*_m{M} variants; a launch of n tokens uses the smallest M >= n
MAX_TOKENS = TOKEN_TILES[-1]
TYPES = frozenset(
    {GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K,
     GGMLType.Q6_K}
)  # fmt: skip


def has(ggml_type: int) -> bool:
    """Whether kernels/tc_matvec.cu builds kernels for this weight type (the quantized common types)."""
    return ggml_type in TYPES


def rows_per_block(kernel: str, tile: int) -> int:
    """Output rows a block: tcmv3 takes two 8-row fragments a block at 16 or 32 tokens (each lane's split of x serves
    both), one at 64; tcmv and tcmv_swiglu one (kernels/tc_matvec.cu, RT_WIDE)."""
    return FRAGMENT_ROWS * (2 if kernel == "tcmv3" and tile < 64 else 1)


def _tile(n: int) -> int:
    for m in TOKEN_TILES:
        if 1 <= n <= m:
            return m
    raise CudaError(f"tcmv takes 1 to {MAX_TOKENS} tokens, got {n}")


def _check(w: DeviceWeight, x: DeviceArray, n: int, y: DeviceArray, norm_w: DeviceArray | None) -> int:
    if not has(w.ggml_type):
        raise CudaError(f"tcmv: no kernel for {w.name}'s type {w.tag}")
    tile = _tile(n)
    need_aligned_weight(w)
    need(x, "x", "f4", n * w.cols, aligned=True)
    need(y, "y", "f4", n * w.rows)
    if norm_w is not None:
        need(norm_w, "norm_w", "f4", w.cols, aligned=True)
    return tile


def _grid(rows: int, kernel: str, tile: int) -> tuple[int]:
    per_block = rows_per_block(kernel, tile)
    return ((rows + per_block - 1) // per_block,)


def tcmv(
    w: DeviceWeight,  # (R, K) GGUF blocks
    x: DeviceArray,  # (n, K) f4
    n: int,  # tokens, 1..64
    y: DeviceArray,  # (n, R) f4; y = resid + w . rmsnorm(x)
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4: RMS-normalise x first (per token), times norm_w
    eps: float = 0.0,
    resid: DeviceArray | None = None,  # (n, R) f4, may be y itself
) -> Launch:
    tile = _check(w, x, n, y, norm_w)
    if resid is not None:
        need(resid, "resid", "f4", n * w.rows)
    fn = driver.module("tc_matvec").fn(f"tcmv_{w.tag}_m{tile}")
    args = [ptr(w.ptr), i64(w.row_bytes), i32(w.rows), i32(w.cols), ptr(x), i32(n), ptr(norm_w), f32(eps), ptr(resid),
            ptr(y)]  # fmt: skip
    return Launch(fn, _grid(w.rows, "tcmv", tile), (one_threads(fn),), args)


def one_threads(fn) -> int:
    """tcmv's block: the threads its kernel was built for (kernels/tc_matvec.cu's WARPS_ONE), read from the kernel so
    that a rebuilt module needs no other change."""
    threads = driver.block_limit(fn)
    if threads not in ONE_THREADS:
        raise CudaError(f"tcmv: a kernel built for {threads} threads a block, not one of {ONE_THREADS}")
    return threads


def tcmv_swiglu(
    wg: DeviceWeight,  # (R, K) GGUF blocks: ffn_gate
    wu: DeviceWeight,  # (R, K) same type and layout: ffn_up
    x: DeviceArray,  # (n, K) f4
    n: int,  # tokens, 1..64
    y: DeviceArray,  # (n, R) f4; y = silu(wg . xn) * (wu . xn), xn = rmsnorm(x) or x
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4
    eps: float = 0.0,
) -> Launch:
    need_same_layout(wg, wu, "tcmv_swiglu")
    tile = _check(wg, x, n, y, norm_w)
    fn = driver.module("tc_matvec").fn(f"tcmv_swiglu_{wg.tag}_m{tile}")
    args = [ptr(wg.ptr), ptr(wu.ptr), i64(wg.row_bytes), i32(wg.rows), i32(wg.cols), ptr(x), i32(n), ptr(norm_w),
            f32(eps), ptr(y)]  # fmt: skip
    return Launch(fn, _grid(wg.rows, "tcmv_swiglu", tile), (32 * WARPS_WIDE,), args)


def tcmv3(
    ws: list[DeviceWeight],  # 1 to 3 matrices (R_m, K) of one width, in an order k_matvec.matvec3_order keeps
    x: DeviceArray,  # (n, K) f4
    n: int,  # tokens, 1..64
    ys: list[DeviceArray],  # (n, R_m) f4 each; ys[m] = ws[m] . rmsnorm(x)
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4
    eps: float = 0.0,
) -> Launch:
    """One launch for the small-batch matmuls of matrices that read the same x (q/k/v): each matrix's results are
    those of a launch of it alone, bit for bit, and agree with `tcmv`'s to float32 rounding (blocks of another shape:
    rows_per_block, WARPS_WIDE)."""
    if not all(has(w.ggml_type) for w in ws):
        raise CudaError(f"tcmv3 takes matrices of tc_matvec's types, got {', '.join(w.tag for w in ws)}")
    tile = max(_check(w, x, n, y, norm_w) for w, y in zip(ws, ys, strict=True))
    tags, weights, outs, blocks = matvec3_operands("tcmv3", ws, ys, rows_per_block("tcmv3", tile))
    fn = driver.module("tc_matvec").fn(f"tcmv3_{tags}_m{tile}")
    args = [*weights, i32(ws[0].cols), ptr(x), i32(n), ptr(norm_w), f32(eps), *outs]
    return Launch(fn, (blocks,), (32 * WARPS_WIDE,), args)
