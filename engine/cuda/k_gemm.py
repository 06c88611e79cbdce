"""Launch wrappers for kernels/gemm.cu: prefill matmuls (n > dispatch.MATVEC_MAX tokens) straight from GGUF blocks,
and the workspace that they and kernels/gemm_tc.cu's (engine/cuda/k_gemm_tc.py) share.

Each function checks its buffers and returns a `driver.Launch` (it does not launch). Names, argument order, grid and
block follow kernels/README.md. Buffers may be larger than needed. A, resid and C are read and written as float4 and
weights as 8-byte words, so all must be 16-byte aligned (cudaMalloc'd arrays and GGUF tensor offsets are). Other
blocks read A while a block writes C, so A must not overlap C; resid is either C itself or apart from it.
"""

from __future__ import annotations

from engine.cuda import dispatch, driver
from engine.cuda.driver import Launch, i32, i64, ptr
from engine.cuda.memory import DeviceArray, DeviceWeight, need, need_aligned_weight, need_same_layout
from engine.errors import CudaError
from engine.quants import BLOCK_SIZES, GGMLType, row_bytes

TILE = 64  # output tile per block: 64 weight rows (grid.x) x 64 tokens (grid.y)
THREADS = 128
SPLIT_STEP = 32  # a K split takes whole stages: multiples of the kernels' 32 (16 in swiglu) values
SLAB_FLOATS = 8 * 2**20  # the dequantized-weight slab: 32 MiB (a Qwen3-0.6B gate + up pair, 2 x 3072 x 1024, fits)


class _Workspace:
    """The split-K launches' partial tiles and per-tile tickets (kernels/gemm_tile.cuh, Split), shared by every GEMM
    of the process: they run one after another on the stream, and each leaves its tickets at zero."""

    def __init__(self) -> None:
        # (S * NW * tiles, 64, 64) f4, which is also gemm_dense's (S * tiles, 128, 64): S * tiles <= GEMM_FULL_BLOCKS
        self.part = DeviceArray.empty((dispatch.GEMM_FULL_BLOCKS * 2 * TILE * TILE,))
        self.tickets = DeviceArray.empty((dispatch.GEMM_FULL_BLOCKS,), "i4")  # (tiles,) i4
        self.tickets.fill_byte(0)
        self.slab: DeviceArray | None = None  # (SLAB_FLOATS,) f4: gemm_dense's, where it may be picked (reserve)


_workspace: _Workspace | None = None


def reserve() -> None:
    """Allocate the split-K workspace (once a process, ~8.7 MB; and the 32 MiB weight slab where REFLEX_PREFILL_GEMM
    names the dense GEMM): GEMMs built after this may split K and take two passes."""
    global _workspace
    if _workspace is None:
        _workspace = _Workspace()
    if _workspace.slab is None and dispatch.prefill_gemm_named() == "dense":
        _workspace.slab = DeviceArray.empty((SLAB_FLOATS,))


def _need(a: DeviceArray, name: str, n: int) -> None:
    need(a, f"gemm {name}", "f4", n, aligned=True)


def _need_weight(w: DeviceWeight) -> None:
    t = GGMLType(w.ggml_type)
    need_aligned_weight(w)
    # The kernels step K by 32 (16 in swiglu) and read each row as whole blocks, row_bytes apart.
    if w.cols % max(32, BLOCK_SIZES[t][0]) or w.row_bytes != row_bytes(t, w.cols):
        raise CudaError(f"gemm weight {w.name}: {w.cols} columns in rows of {w.row_bytes} bytes is not whole "
                        f"{w.tag} blocks in multiples of 32 values")  # fmt: skip


def _overlap(a: DeviceArray, a_elems: int, b: DeviceArray, b_elems: int) -> bool:
    return a.ptr < b.ptr + 4 * b_elems and b.ptr < a.ptr + 4 * a_elems


def check_operands(w: DeviceWeight, a: DeviceArray, n: int, c: DeviceArray) -> None:
    """A prefill matmul's operands: n in range, w whole blocks aligned, A (n, K) and C (n, R) aligned, apart."""
    if not 1 <= n <= 65535 * TILE:  # grid.y <= 65535
        raise CudaError(f"gemm: n={n} must be in 1..{65535 * TILE}")
    _need_weight(w)
    _need(a, "A", n * w.cols)
    _need(c, "C", n * w.rows)
    if _overlap(a, n * w.cols, c, n * w.rows):
        raise CudaError("gemm: A overlaps C")


def check_resid(resid: DeviceArray | None, c: DeviceArray, n: int, rows: int) -> None:
    """An optional (n, rows) residual: aligned, and either C itself or apart from it."""
    if resid is not None:
        _need(resid, "resid", n * rows)
        if resid.ptr != c.ptr and _overlap(resid, n * rows, c, n * rows):
            raise CudaError("gemm: resid overlaps C without being C")


def workspace() -> _Workspace | None:
    """The workspace reserve() allocated, or None before it."""
    return _workspace


def _grid(w: DeviceWeight, n: int, split: bool) -> tuple[tuple[int, int, int], list]:
    """(grid, the workspace arguments): K split over grid.z where dispatch.gemm_splits asks for it and the
    workspace is reserved."""
    gx, gy = (w.rows + TILE - 1) // TILE, (n + TILE - 1) // TILE
    s = dispatch.gemm_splits(gx * gy, w.cols // SPLIT_STEP) if split and _workspace is not None else 1
    if s == 1:
        return (gx, gy, 1), [ptr(None), ptr(None)]
    return (gx, gy, s), [ptr(_workspace.part), ptr(_workspace.tickets)]


def gemm(
    w: DeviceWeight,  # (R, K) GGUF blocks
    a: DeviceArray,  # (n, K) f4
    n: int,  # tokens, >= 1
    c: DeviceArray,  # (n, R) f4; c = a . w^T (+ resid)
    *,
    resid: DeviceArray | None = None,  # (n, R) f4: c itself (in-place residual add) or a separate array
    split: bool = True,  # False: no split-K, whatever the rule says (tests compare both)
) -> Launch:
    check_operands(w, a, n, c)
    check_resid(resid, c, n, w.rows)
    fn = driver.module("gemm").fn(f"gemm_{w.tag}")
    grid, work = _grid(w, n, split)
    args = [ptr(w.ptr), i64(w.row_bytes), i32(w.rows), i32(w.cols), ptr(a), i32(n), ptr(resid), ptr(c), *work]
    return Launch(fn, grid, (THREADS,), args)


def gemm_swiglu(
    wg: DeviceWeight,  # (R, K) GGUF blocks: ffn_gate
    wu: DeviceWeight,  # (R, K) same type and layout: ffn_up
    a: DeviceArray,  # (n, K) f4
    n: int,  # tokens, >= 1
    c: DeviceArray,  # (n, R) f4; c = silu(a . wg^T) * (a . wu^T)
    *,
    split: bool = True,
) -> Launch:
    need_same_layout(wg, wu, "gemm_swiglu")
    check_operands(wg, a, n, c)
    _need_weight(wu)
    fn = driver.module("gemm").fn(f"gemm_swiglu_{wg.tag}")
    grid, work = _grid(wg, n, split)
    args = [ptr(wg.ptr), ptr(wu.ptr), i64(wg.row_bytes), i32(wg.rows), i32(wg.cols), ptr(a), i32(n), ptr(c), *work]
    return Launch(fn, grid, (THREADS,), args)
