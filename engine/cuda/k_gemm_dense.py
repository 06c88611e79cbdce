"""Launch wrappers for kernels/gemm_dense.cu: a prefill matmul in two passes, the weights dequantized into a float
slab (dequant_tf32_{t}) and a dense TF32 GEMM over it (gemm_dense), per slab of output columns that the scratch holds
(contract: kernels/README.md). engine/cuda/prefill.py chooses it or gemm.cu's one pass (dispatch.dense_gemm)."""

from __future__ import annotations

from engine.cuda import dispatch, driver
from engine.cuda.driver import Launch, i32, i64, ptr
from engine.cuda.k_gemm import SPLIT_STEP, TILE, check_operands, check_resid, workspace
from engine.cuda.memory import DeviceArray, DeviceWeight, need, need_same_layout
from engine.errors import CudaError
from engine.quants import FLOAT_TYPES

TOKENS = 128  # gemm_dense's tile: 128 tokens (grid.y) x TILE = 64 slab rows (grid.x); its stages are 32 values
THREADS = 128
SMEM = 4 * 4 * (TOKENS + TILE) * 36  # 4 stages of A and W tiles in rows of 32 + 4 floats: 110,592 bytes
DEQUANT_GROUPS = 256  # 8-value groups of the slab one dequant_tf32 block writes


def gemm_dense(
    w: DeviceWeight,  # (R, K) GGUF blocks, a quantized type; the gate of a pair
    a: DeviceArray,  # (n, K) f4
    n: int,  # tokens, >= 1
    c: DeviceArray,  # (n, R) f4
    *,
    resid: DeviceArray | None = None,  # (n, R) f4, one matrix only: c itself or a separate array
    up: DeviceWeight | None = None,  # (R, K), the same layout as w: c = silu(a . w^T) * (a . up^T)
    slab: DeviceArray | None = None,  # f4 scratch for the dequantized rows; default the workspace's (k_gemm.reserve)
    split: bool = True,  # False: no split-K (tests compare both)
) -> list[Launch]:  # fmt: skip
    """c = a . w^T (+ resid), or the SwiGLU of (w, up): for each slab of output columns, a dequant_tf32 launch (the
    rows tf32-rounded; a pair interleaved in groups of 32 rows) and a gemm_dense launch into c's columns of the slab.
    sm_80 and later."""
    pair = up is not None
    if pair:
        need_same_layout(w, up, "gemm_dense")
        if resid is not None:
            raise CudaError("gemm_dense: a SwiGLU pair takes no residual")
    check_operands(w, a, n, c)
    if w.ggml_type in FLOAT_TYPES:
        raise CudaError(f"gemm_dense: {w.name} is {w.tag}; float weights take gemm's exact float32 path")
    if driver.compute_major() < 8:
        raise CudaError("gemm_dense: tf32 tensor cores and cp.async need sm_80 or later")
    check_resid(resid, c, n, w.rows)
    work = workspace()
    if slab is None:
        if work is None or work.slab is None:
            raise CudaError("gemm_dense: no weight slab (k_gemm.reserve with REFLEX_GEMM_DENSE=1, or pass one)")
        slab = work.slab
    R, K = w.rows, w.cols
    unit = 32 if pair else TILE  # output columns a slab holds: whole tiles
    per_col = 2 * K if pair else K  # slab floats an output column takes
    cols = slab.size // per_col // unit * unit
    if cols < 1:
        raise CudaError(f"gemm_dense: a slab of {slab.size} floats holds no {unit} columns of {per_col} floats")
    need(slab, "gemm_dense slab", "f4", min(cols, _round_up(R, unit)) * per_col, aligned=True)
    dequant = driver.module("gemm_dense").fn(f"dequant_tf32_{w.tag}")
    fn = driver.module("gemm_dense").fn("gemm_dense")
    driver.allow_smem(fn, SMEM)
    launches = []
    for r0 in range(0, R, cols):
        rows = min(cols, R - r0)
        slab_rows = 2 * _round_up(rows, 32) if pair else rows
        groups = slab_rows * K // 8
        launches.append(Launch(dequant, ((groups + DEQUANT_GROUPS - 1) // DEQUANT_GROUPS,), (DEQUANT_GROUPS,),
                               [ptr(w.ptr), ptr(up.ptr if pair else None), i64(w.row_bytes), i32(R), i32(K), i32(r0),
                                i32(rows), i32(slab_rows), ptr(slab)]))  # fmt: skip
        gx, gy = (slab_rows + TILE - 1) // TILE, (n + TOKENS - 1) // TOKENS
        s = dispatch.gemm_splits(gx * gy, K // SPLIT_STEP) if split and work is not None else 1
        parts = [ptr(work.part), ptr(work.tickets)] if s > 1 else [ptr(None), ptr(None)]
        args = [ptr(slab), i32(slab_rows), i32(K), ptr(a), i32(n), ptr(resid), ptr(c), i32(R), i32(r0), i32(rows),
                i32(1 if pair else 0), *parts]  # fmt: skip
        launches.append(Launch(fn, (gx, gy, s), (THREADS,), args, smem=SMEM))
    return launches


def _round_up(x: int, unit: int) -> int:
    return (x + unit - 1) // unit * unit
