"""Launch wrappers for kernels/gemm_tc.cu, prefill matmuls on a pipelined TF32 tile (contract: kernels/README.md):
in two passes, the weights dequantized into a float slab (dequant_tf32_{t}) and a dense GEMM over it (gemm_dense),
per slab of output columns that the scratch holds; or in one, the GGUF rows staged raw and dequantized beside the
multiply (gemm_pipe_{t}). engine/cuda/prefill.py chooses between them and gemm.cu (dispatch.prefill_gemm)."""

from __future__ import annotations

import itertools

from engine.cuda import dispatch, driver
from engine.cuda.driver import Launch, i32, i64, ptr
from engine.cuda.k_gemm import SPLIT_STEP, TILE, check_operands, check_resid, workspace
from engine.cuda.memory import DeviceArray, DeviceWeight, need, need_same_layout
from engine.errors import CudaError
from engine.quants import BLOCK_SIZES, FLOAT_TYPES, KERNEL_TAGS, GGMLType

TOKENS = 128  # gemm_dense's tile: 128 tokens (grid.y) x TILE = 64 slab rows (grid.x); its stages are 32 values
THREADS = 128
STAGES = 4  # kernels/gemm_tc.cu's NSTAGE
SMEM = 4 * STAGES * (TOKENS + TILE) * 36  # the stages' A and W tiles in rows of 32 + 4 floats: 110,592 bytes
STATIC_SMEM = 128  # the kernel's own (its ticket), beside SMEM in a block's share
DEQUANT_GROUPS = 256  # 8-value groups of the slab one dequant_tf32 block writes
PIPE_STAGES, RAW_K = 3, 256  # gemm_pipe: A's ring; K values of a raw slice of weight rows (whole blocks)
PIPE_THREADS = (256, 128)  # gemm_pipe's blocks: 8 warps (the build's default, first) or 4 (-DPIPE_WARPS=4)


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
    Where fits()."""
    _check_call("gemm_dense", w, up, a, n, c, resid)
    return _two_pass([w], up, a, n, [c], resid, slab, split)


def gemm_dense3(
    ws: list[DeviceWeight],  # 1 to 3 matrices (R_m, K) of one width (q/k/v), quantized, of any types
    a: DeviceArray,  # (n, K) f4
    n: int,
    cs: list[DeviceArray],  # (n, R_m) f4 each: cs[m] = a . ws[m]^T
    *,
    slab: DeviceArray | None = None,
    split: bool = True,
) -> list[Launch]:  # fmt: skip
    """gemm_dense of up to three matrices at once: their rows dequantized into one slab (a dequant_tf32 launch a
    matrix), one gemm_dense launch over it writing each matrix's columns to its own output."""
    if not 1 <= len(ws) <= 3 or len(ws) != len(cs):
        raise CudaError(f"gemm_dense3: 1 to 3 matrices and as many outputs, got {len(ws)} and {len(cs)}")
    if len({w.cols for w in ws}) != 1:
        raise CudaError(f"gemm_dense3: matrices of one width, got {[w.cols for w in ws]}")
    for w, c in zip(ws, cs, strict=True):
        _check(w, a, n, c)
    return _two_pass(ws, None, a, n, cs, None, slab, split)


_fits: dict[int, bool] = {}


def fits(device: int = 0) -> bool:
    """Whether the GPU runs gemm_tc.cu's kernels: sm_80 or later (tf32 mma, cp.async) with MAX_SMEM of shared memory
    a block (sm_80 and sm_90 have it; sm_86 and sm_89 allow 99 KiB). Read once a device."""
    if device not in _fits:
        limit = driver.attribute(driver.SMEM_OPTIN_LIMIT, device)
        _fits[device] = driver.compute_major(device) >= 8 and limit >= MAX_SMEM + STATIC_SMEM
    return _fits[device]


def pipe_smem(ggml_type: GGMLType) -> int:
    """gemm_pipe's dynamic shared memory for weights of this type: A's ring, two float W tiles, two raw slices
    (kernels/gemm_tc.cu pipe_smem_bytes; 112,640 bytes at most, for Q8_0's 272-byte slices)."""
    qk, nbytes = BLOCK_SIZES[ggml_type]
    pitch = (RAW_K // qk * nbytes + 30) // 16 * 16  # stage.cuh pitch: a slice's bytes and its head offset, granules
    pitch += 0 if pitch // 16 % 2 else 16  # an odd number of granules (odd_granules)
    return 4 * (PIPE_STAGES * TOKENS * 36 + 2 * TILE * 36) + 2 * TILE * pitch


# The most dynamic shared memory a gemm_tc.cu kernel takes (two blocks an SM of it fit an sm_90's 228 KiB).
MAX_SMEM = max(SMEM, *(pipe_smem(t) for t in KERNEL_TAGS if t not in FLOAT_TYPES))


def gemm_pipe(
    w: DeviceWeight,  # (R, K) GGUF blocks, a quantized type; the gate of a pair
    a: DeviceArray,  # (n, K) f4
    n: int,  # tokens, >= 1
    c: DeviceArray,  # (n, R) f4
    *,
    resid: DeviceArray | None = None,  # (n, R) f4, one matrix only: c itself or a separate array
    up: DeviceWeight | None = None,  # (R, K), the same layout as w: c = silu(a . w^T) * (a . up^T)
    split: bool = True,  # False: no split-K (tests compare both)
) -> Launch:  # fmt: skip
    """c = a . w^T (+ resid), or the SwiGLU of (w, up), in one launch of gemm_pipe_{t}. Where fits()."""
    _check_call("gemm_pipe", w, up, a, n, c, resid)
    smem = pipe_smem(w.ggml_type)
    fn = driver.module("gemm_tc").fn(f"gemm_pipe_{w.tag}")
    driver.allow_smem(fn, smem, most_shared=True)
    gx = (w.rows + (TILE // 2 if up else TILE) - 1) // (TILE // 2 if up else TILE)
    gy = (n + TOKENS - 1) // TOKENS
    work = workspace()
    unit = max(SPLIT_STEP, BLOCK_SIZES[w.ggml_type][0])  # a split takes whole blocks and whole stages
    s = dispatch.gemm_splits(gx * gy, w.cols // unit) if split and work is not None else 1
    parts = [ptr(work.part), ptr(work.tickets)] if s > 1 else [ptr(None), ptr(None)]
    args = [ptr(w.ptr), ptr(up.ptr if up is not None else None), i64(w.row_bytes), i32(w.rows), i32(w.cols), ptr(a),
            i32(n), ptr(resid), ptr(c), i32(1 if up is not None else 0), *parts]  # fmt: skip
    return Launch(fn, (gx, gy, s), (pipe_threads(fn),), args, smem=smem)


def pipe_threads(fn) -> int:
    """gemm_pipe's block: the threads its kernel was built for (kernels/gemm_tc.cu's PIPE_WARPS: 8 warps, or 4 in
    that A/B form), read from the kernel so that a rebuilt module needs no other change."""
    threads = driver.block_limit(fn)
    if threads not in PIPE_THREADS:
        raise CudaError(f"gemm_pipe: a kernel built for {threads} threads a block, not one of {PIPE_THREADS}")
    return threads


def _check_call(what: str, w: DeviceWeight, up: DeviceWeight | None, a: DeviceArray, n: int, c: DeviceArray,
                resid: DeviceArray | None) -> None:  # fmt: skip
    """One matrix (with an optional residual) or a SwiGLU pair of one layout (without)."""
    if up is not None:
        need_same_layout(w, up, what)
        if resid is not None:
            raise CudaError(f"{what}: a SwiGLU pair takes no residual")
    _check(w, a, n, c)
    check_resid(resid, c, n, w.rows)


def _check(w: DeviceWeight, a: DeviceArray, n: int, c: DeviceArray) -> None:
    check_operands(w, a, n, c)
    if w.ggml_type in FLOAT_TYPES:
        raise CudaError(f"gemm_tc: {w.name} is {w.tag}; float weights take gemm's exact float32 path")
    if not fits():
        raise CudaError(f"gemm_tc: needs sm_80 or later and {MAX_SMEM + STATIC_SMEM} bytes of shared memory a block")


def _two_pass(ws: list[DeviceWeight], up: DeviceWeight | None, a: DeviceArray, n: int, cs: list[DeviceArray],
              resid: DeviceArray | None, slab: DeviceArray | None, split: bool) -> list[Launch]:  # fmt: skip
    """The launches over the output columns of ws one after another (or of the pair ws[0], up), slab by slab."""
    work = workspace()
    if slab is None:
        if work is None or work.slab is None:
            raise CudaError("gemm_dense: no weight slab (k_gemm.reserve with REFLEX_PREFILL_GEMM=dense, or pass one)")
        slab = work.slab
    pair, K = up is not None, ws[0].cols
    ends = list(itertools.accumulate(w.rows for w in ws))  # output column ends of the matrices
    total = ends[-1]
    unit = 32 if pair else TILE  # output columns a slab holds: whole tiles
    per_col = 2 * K if pair else K  # slab floats an output column takes
    cols = slab.size // per_col // unit * unit
    if cols < 1:
        raise CudaError(f"gemm_dense: a slab of {slab.size} floats holds no {unit} columns of {per_col} floats")
    need(slab, "gemm_dense slab", "f4", min(cols, _round_up(total, unit)) * per_col, aligned=True)
    fn = driver.module("gemm_tc").fn("gemm_dense")
    driver.allow_smem(fn, SMEM, most_shared=True)  # two blocks an SM: 2 x 108 KiB of the 228 KiB an sm_90 has
    segments = [ptr(c) for c in cs] + [ptr(cs[-1])] * (3 - len(cs))
    segment_ends = [i32(e) for e in ends + [total] * (3 - len(ends))]
    launches = []
    for r0 in range(0, total, cols):
        rows = min(cols, total - r0)
        slab_rows = 2 * _round_up(rows, 32) if pair else rows
        if pair:
            launches.append(_dequant(ws[0], up, r0, rows, slab_rows, slab))
        for w, end in zip(ws if not pair else [], ends, strict=False):  # the rows of each matrix in this slab
            first, lo, hi = end - w.rows, max(r0, end - w.rows), min(r0 + rows, end)
            if lo < hi:
                part = slab.view((lo - r0) * K, ((hi - lo) * K,))  # its slab rows
                launches.append(_dequant(w, None, lo - first, hi - lo, hi - lo, part))
        gx, gy = (slab_rows + TILE - 1) // TILE, (n + TOKENS - 1) // TOKENS
        s = dispatch.gemm_splits(gx * gy, K // SPLIT_STEP) if split and work is not None else 1
        parts = [ptr(work.part), ptr(work.tickets)] if s > 1 else [ptr(None), ptr(None)]
        args = [ptr(slab), i32(slab_rows), i32(K), ptr(a), i32(n), ptr(resid), *segments, *segment_ends, i32(r0),
                i32(rows), i32(1 if pair else 0), *parts]  # fmt: skip
        launches.append(Launch(fn, (gx, gy, s), (THREADS,), args, smem=SMEM))
    return launches


def _dequant(w: DeviceWeight, up: DeviceWeight | None, r0: int, rows: int, slab_rows: int, out: DeviceArray) -> Launch:
    """dequant_tf32 of w's rows [r0, r0 + rows) (with up's, interleaved, for a pair) into out's first slab_rows rows."""
    fn = driver.module("gemm_tc").fn(f"dequant_tf32_{w.tag}")
    groups = slab_rows * w.cols // 8
    return Launch(fn, ((groups + DEQUANT_GROUPS - 1) // DEQUANT_GROUPS,), (DEQUANT_GROUPS,),
                  [ptr(w.ptr), ptr(up.ptr if up is not None else None), i64(w.row_bytes), i32(w.rows), i32(w.cols),
                   i32(r0), i32(rows), i32(slab_rows), ptr(out)])  # fmt: skip


def _round_up(x: int, unit: int) -> int:
    return (x + unit - 1) // unit * unit
