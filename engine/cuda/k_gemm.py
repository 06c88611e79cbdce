"""Launch wrappers for kernels/gemm.cu: prefill matmuls (n > dispatch.MATVEC_MAX tokens) straight from GGUF blocks.

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


class _Workspace:
    """The split-K launches' partial tiles and per-tile tickets (kernels/gemm_tile.cuh, Split), shared by every GEMM
    of the process: they run one after another on the stream, and each leaves its tickets at zero."""

    def __init__(self) -> None:
        self.part = DeviceArray.empty((dispatch.GEMM_FULL_BLOCKS * 2 * TILE * TILE,))  # (S * NW * tiles, 64, 64) f4
        self.tickets = DeviceArray.empty((dispatch.GEMM_FULL_BLOCKS,), "i4")  # (tiles,) i4
        self.tickets.fill_byte(0)


_workspace: _Workspace | None = None


def reserve() -> None:
    """Allocate the split-K workspace (once a process, ~8.7 MB): GEMMs built after this may split K."""
    global _workspace
    if _workspace is None:
        _workspace = _Workspace()


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


def _check(w: DeviceWeight, a: DeviceArray, n: int, c: DeviceArray) -> None:
    if not 1 <= n <= 65535 * TILE:  # grid.y <= 65535
        raise CudaError(f"gemm: n={n} must be in 1..{65535 * TILE}")
    _need_weight(w)
    _need(a, "A", n * w.cols)
    _need(c, "C", n * w.rows)
    if _overlap(a, n * w.cols, c, n * w.rows):
        raise CudaError("gemm: A overlaps C")


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
    _check(w, a, n, c)
    if resid is not None:
        _need(resid, "resid", n * w.rows)
        if resid.ptr != c.ptr and _overlap(resid, n * w.rows, c, n * w.rows):
            raise CudaError("gemm: resid overlaps C without being C")
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
    _check(wg, a, n, c)
    _need_weight(wu)
    fn = driver.module("gemm").fn(f"gemm_swiglu_{wg.tag}")
    grid, work = _grid(wg, n, split)
    args = [ptr(wg.ptr), ptr(wu.ptr), i64(wg.row_bytes), i32(wg.rows), i32(wg.cols), ptr(a), i32(n), ptr(c), *work]
    return Launch(fn, grid, (THREADS,), args)
