"""kernels/gemm.cu (prefill matmuls) against NumPy float64 on the dequantized weights.

Fresh random inputs every run; the seed is in every failure message and GEMM_SEED=<seed> replays it. Outputs are
poisoned (0xFF bytes: NaN) first and framed by poisoned guard floats, so an unwritten element or a write past the
output fails. Weights, activations and residuals are allocated to the byte, so compute-sanitizer sees any overrun.
Error measure: per token, |C - ref| / |ref| over the row of R outputs. Float types are exact float32 (every row within
1e-5). Quantized types use TF32 tensor cores on sm_80+: A and W rounded to 10-bit mantissas, float32 accumulation.
Simulated in NumPy over these shapes, that gives rows at 3e-4 typically (the median row of a launch at most 5e-4 for
gemm, 8e-4 for swiglu) and single rows up to 1.3e-3 (gemm) and 3.2e-3 (swiglu) when R and K are small; the bounds
below sit above those, and under what truncating instead of rounding gives (medians up to 1e-3 and 1.7e-3).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.cuda import driver, k_gemm, k_gemm_tc, memory, prefill
from engine.cuda.memory import DeviceArray
from engine.errors import CudaError, InvalidInput
from engine.quants import FLOAT_TYPES, KERNEL_TAGS, GGMLType
from tests.cuda_util import Weight, cuda_context, needs_blocks  # noqa: F401 - cuda_context: autouse fixture

pytestmark = pytest.mark.gpu

TYPES = sorted(KERNEL_TAGS)  # the types the kernels compute
# (n, R, K): n and R below, at and past multiples of the 64 x 64 tile (R = 33: rows not a multiple of 4, so the
# scalar store path); K from one K-quant block to Qwen3-0.6B's ffn_down.
SHAPES = [(9, 64, 256), (64, 100, 1024), (65, 1024, 256), (200, 3072, 1024), (512, 1024, 3072), (130, 33, 256)]
SMALL_K = [(65, 100, 32), (9, 64, 96), (200, 70, 96)]  # 1 or 3 blocks per row: not for K-quants
GUARD = 64  # poisoned floats before and after each output (keeps the output 16-byte aligned)
POISON = 0xFFFFFFFF


def tolerance(ggml_type: GGMLType, swiglu: bool = False) -> tuple[float, float]:
    """(bound on every token row, bound on the median row) of the relative error; see the module docstring."""
    if ggml_type in FLOAT_TYPES:
        return 1e-5, 1e-5
    return (5e-3, 1.2e-3) if swiglu else (2.5e-3, 7e-4)  # silu(g) * u carries both products' errors


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("GEMM_SEED") or np.random.default_rng().integers(2**63))


class Output:
    """An (n, R) f4 output inside a poisoned frame of GUARD floats on each side."""

    def __init__(self, n: int, rows: int, initial: np.ndarray | None = None):
        self.frame = DeviceArray.empty((n * rows + 2 * GUARD,), "f4")
        self.frame.fill_byte(0xFF)
        self.c = self.frame.view(GUARD, (n, rows))
        if initial is not None:
            self.c.copy_from_host(initial)

    def result(self, context: str) -> np.ndarray:
        host = self.frame.to_host()
        frame = np.concatenate([host[:GUARD], host[-GUARD:]]).view(np.uint32)
        assert (frame == POISON).all(), f"{context}: written outside the output"
        got = host[GUARD:-GUARD].reshape(self.c.shape)
        assert not np.isnan(got).any(), (
            f"{context}: unwritten (NaN) outputs at {np.argwhere(np.isnan(got))[:8].tolist()}"
        )
        return got


def run(launch: driver.Launch) -> None:
    launch()
    memory.synchronize(0)


def activations(rng: np.random.Generator, n: int, cols: int) -> np.ndarray:
    return rng.normal(size=(n, cols)).astype(np.float32)  # (n, cols), O(1) like RMS-normed rows


def operands(rng: np.random.Generator, ggml_type: GGMLType, n: int, rows: int,
             cols: int) -> tuple[Weight, Weight, np.ndarray, np.ndarray]:  # fmt: skip
    """Two (rows, cols) weights of one type (a SwiGLU pair, or a matrix and a spare), (n, cols) activations and an
    (n, rows) residual."""
    w, wu = Weight(rng, ggml_type, rows, cols), Weight(rng, ggml_type, rows, cols)
    return w, wu, activations(rng, n, cols), rng.normal(size=(n, rows)).astype(np.float32)


def assert_rows_close(got: np.ndarray, ref: np.ndarray, tol: tuple[float, float], context: str) -> None:
    err = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)  # (n,)
    worst, median = int(np.argmax(err)), float(np.median(err))
    summary = f"worst token {worst} at {err[worst]:.3g}, median {median:.3g}"
    assert err[worst] <= tol[0], (
        f"{context}: {(err > tol[0]).sum()} of {len(err)} token rows outside {tol[0]:g}; {summary}"
    )
    assert median <= tol[1], f"{context}: median row error above {tol[1]:g}; {summary}"


@pytest.mark.parametrize("shape", SHAPES + SMALL_K, ids=lambda s: "n{}_R{}_K{}".format(*s))
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gemm(ggml_type: GGMLType, shape: tuple[int, int, int], seed: int) -> None:
    n, rows, cols = shape
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    w = Weight(rng, ggml_type, rows, cols)
    a = activations(rng, n, cols)
    out = Output(n, rows)
    d_a = DeviceArray.from_host(a)  # held here: a Launch keeps raw pointers, not the arrays
    run(k_gemm.gemm(w.dev, d_a, n, out.c))
    context = f"gemm {ggml_type.name} n={n} R={rows} K={cols} seed={seed}"
    assert_rows_close(out.result(context), a.astype(np.float64) @ w.dense.T, tolerance(ggml_type), context)


@pytest.mark.parametrize("in_place", [False, True], ids=["resid", "resid_is_c"])
@pytest.mark.parametrize("shape", [(65, 100, 256), (200, 1024, 1024)], ids=lambda s: "n{}_R{}_K{}".format(*s))
@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K],
                         ids=lambda t: t.name)  # fmt: skip
def test_gemm_residual(ggml_type: GGMLType, shape: tuple[int, int, int], in_place: bool, seed: int) -> None:
    n, rows, cols = shape
    rng = np.random.default_rng(seed)
    w = Weight(rng, ggml_type, rows, cols)
    a = activations(rng, n, cols)
    resid = rng.normal(size=(n, rows)).astype(np.float32)  # (n, R): the residual stream, O(1)
    if in_place:  # C starts as the residual and is updated in place
        out = Output(n, rows, initial=resid)
        d_resid = out.c
    else:
        out, d_resid = Output(n, rows), DeviceArray.from_host(resid)
    d_a = DeviceArray.from_host(a)
    run(k_gemm.gemm(w.dev, d_a, n, out.c, resid=d_resid))
    context = f"gemm+resid {ggml_type.name} in_place={in_place} n={n} R={rows} K={cols} seed={seed}"
    product = a.astype(np.float64) @ w.dense.T
    got = out.result(context)
    # The product's error, measured against the product (the residual itself is added exactly but for one rounding).
    max_tol, median_tol = tolerance(ggml_type)
    assert_rows_close(got - resid, product, (max_tol + 1e-6, median_tol + 1e-6), context)
    if not in_place:
        assert (d_resid.to_host() == resid).all(), f"{context}: resid modified"


@pytest.mark.parametrize("shape", [(9, 64, 256), (65, 100, 1024), (200, 3072, 1024)],
                         ids=lambda s: "n{}_R{}_K{}".format(*s))  # fmt: skip
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gemm_swiglu(ggml_type: GGMLType, shape: tuple[int, int, int], seed: int) -> None:
    n, rows, cols = shape
    rng = np.random.default_rng(seed)
    wg, wu = Weight(rng, ggml_type, rows, cols), Weight(rng, ggml_type, rows, cols)
    a = activations(rng, n, cols)
    out = Output(n, rows)
    d_a = DeviceArray.from_host(a)
    run(k_gemm.gemm_swiglu(wg.dev, wu.dev, d_a, n, out.c))
    a64 = a.astype(np.float64)
    g, u = a64 @ wg.dense.T, a64 @ wu.dense.T  # (n, R)
    context = f"gemm_swiglu {ggml_type.name} n={n} R={rows} K={cols} seed={seed}"
    assert_rows_close(out.result(context), g / (1 + np.exp(-g)) * u, tolerance(ggml_type, swiglu=True), context)


def test_wrapper_checks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = Weight(rng, GGMLType.Q4_K, 64, 256)
    a, c = DeviceArray.empty((9, 256)), DeviceArray.empty((9, 64))
    k_gemm.gemm(w.dev, a, 9, c)  # the valid call
    with pytest.raises(CudaError, match="n=0"):
        k_gemm.gemm(w.dev, a, 0, c)
    with pytest.raises(CudaError, match="needs 2560"):
        k_gemm.gemm(w.dev, a, 10, c)  # A (and C) too small for 10 tokens
    with pytest.raises(CudaError, match="aligned"):
        k_gemm.gemm(w.dev, a.view(1, (9 * 256 - 1,)), 8, c)
    with pytest.raises(CudaError, match="overlaps"):
        k_gemm.gemm(w.dev, a, 9, a.view(0, (9 * 64,)))
    with pytest.raises(CudaError, match="resid"):
        k_gemm.gemm(w.dev, a, 9, c, resid=DeviceArray.empty((9, 63)))
    wu = Weight(rng, GGMLType.Q6_K, 64, 256)
    with pytest.raises(CudaError, match="differ"):
        k_gemm.gemm_swiglu(w.dev, wu.dev, a, 9, c)


# Split-K (kernels/gemm_tile.cuh, Split): grids of few 64 x 64 tiles, where dispatch.gemm_splits splits K.
SPLIT_SHAPES = [(65, 100, 1024), (130, 1024, 3072), (200, 33, 256), (64, 64, 2048)]


@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "n{}_R{}_K{}".format(*s))
@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.IQ4_XS],
                         ids=lambda t: t.name)  # fmt: skip
def test_gemm_split_k(ggml_type: GGMLType, shape: tuple[int, int, int], seed: int) -> None:
    """Split over grid.z, the partials summed by the tile's last block: the bounds of the whole-K kernel, the same
    result bit for bit from one launch to the next (fixed summing order; each launch leaves its tickets at zero), and
    the in-place residual and SwiGLU forms too."""
    n, rows, cols = shape
    needs_blocks(ggml_type, cols)
    k_gemm.reserve()
    w, wu, a, resid = operands(np.random.default_rng(seed), ggml_type, n, rows, cols)
    d_a = DeviceArray.from_host(a)
    context = f"split gemm {ggml_type.name} n={n} R={rows} K={cols} seed={seed}"
    launch = k_gemm.gemm(w.dev, d_a, n, Output(n, rows).c)
    assert launch.grid[2] > 1, f"{context}: grid {launch.grid} not split"
    a64 = a.astype(np.float64)
    product = a64 @ w.dense.T
    results = []
    for _ in range(2):
        out = Output(n, rows, initial=resid)
        run(k_gemm.gemm(w.dev, d_a, n, out.c, resid=out.c))
        got = out.result(context)
        assert_rows_close(got - resid, product, tolerance(ggml_type), context)
        results.append(got)
    assert (results[0] == results[1]).all(), f"{context}: two launches differ"
    whole = Output(n, rows, initial=resid)
    run(k_gemm.gemm(w.dev, d_a, n, whole.c, resid=whole.c, split=False))
    assert_rows_close(whole.result(context) - resid, product, tolerance(ggml_type), context + " unsplit")
    out = Output(n, rows)
    run(k_gemm.gemm_swiglu(w.dev, wu.dev, d_a, n, out.c))
    g, u = product, a64 @ wu.dense.T
    context = context.replace("gemm", "gemm_swiglu")
    assert_rows_close(out.result(context), g / (1 + np.exp(-g)) * u, tolerance(ggml_type, swiglu=True), context)


# The two-pass GEMM (kernels/gemm_tc.cu, k_gemm_tc.gemm_dense): sm_80 and later, quantized types; one matrix
# (with a residual, separate or in place) or the interleaved SwiGLU pair, over slabs of the output columns. Its
# roundings are gemm's (tf32 operands, float32 sums in the same k order), so it is held to gemm's bounds and, unsplit,
# to gemm's own result (AGAINST_GEMM); the slab is poisoned first, so a slab row the dequant pass leaves
# unwritten shows.
QUANT_TYPES = [t for t in TYPES if t not in FLOAT_TYPES]
# (n, R, K): tokens below, at and past the 128-token tile; R past 64- and 32-row tiles, not a multiple of 4 (scalar
# stores); K from one K-quant block to Qwen3-0.6B's ffn_down.
DENSE_SHAPES = [(300, 100, 256), (129, 1024, 1024), (512, 70, 96), (65, 33, 256), (256, 160, 3072)]
# Against gemm.cu unsplit: the same rounded operands and k order, but gemm.cu's wmma m16n16k8 steps are other tensor
# core instructions (HMMA.1684 pairs, not HMMA.1688), whose accumulator rounding inside a k step is not documented:
# emulated, rounding after 8 products and truncating gives rows up to 1e-5 apart at K = 3072, rounding to nearest 7e-7.
# A layout slip would put rows O(1) apart.
AGAINST_GEMM = (2e-5, 2e-5)


def needs_dense() -> None:
    if not k_gemm_tc.fits():
        pytest.skip("gemm_dense needs sm_80 or later and 110 KiB of shared memory a block")


def poisoned_slab(floats: int) -> DeviceArray:
    slab = DeviceArray.empty((floats,))
    slab.fill_byte(0xFF)
    return slab


@pytest.mark.parametrize("split", [False, True], ids=["whole_k", "split_k"])
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=lambda s: "n{}_R{}_K{}".format(*s))
@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: t.name)
def test_gemm_dense(ggml_type: GGMLType, shape: tuple[int, int, int], split: bool, seed: int) -> None:
    needs_dense()
    n, rows, cols = shape
    needs_blocks(ggml_type, cols)
    k_gemm.reserve()
    wg, wu, a, resid = operands(np.random.default_rng(seed), ggml_type, n, rows, cols)
    d_a, d_resid = DeviceArray.from_host(a), DeviceArray.from_host(resid)
    slab = poisoned_slab(64 * cols)  # 64 columns a slab (32 of a pair): R = 100 takes 2 slabs (4 as a pair)
    context = f"gemm_dense {ggml_type.name} n={n} R={rows} K={cols} split={split} seed={seed}"
    a64 = a.astype(np.float64)
    g, u = a64 @ wg.dense.T, a64 @ wu.dense.T

    out = Output(n, rows)
    launches = k_gemm_tc.gemm_dense(wg.dev, d_a, n, out.c, slab=slab, split=split)
    assert len(launches) == 2 * -(-rows // 64), f"{context}: {len(launches)} launches"
    for launch in launches:
        launch()
    memory.synchronize(0)
    got = out.result(context)
    assert_rows_close(got, g, tolerance(ggml_type), context)
    whole = Output(n, rows)
    run(k_gemm.gemm(wg.dev, d_a, n, whole.c, split=False))
    if not split:  # gemm's roundings and k order: its own result within the accumulators' rounding
        assert_rows_close(got, whole.result(context), AGAINST_GEMM, context + " against gemm")

    out = Output(n, rows)
    for launch in k_gemm_tc.gemm_dense(wg.dev, d_a, n, out.c, resid=d_resid, slab=slab, split=split):
        launch()
    memory.synchronize(0)
    assert_rows_close(out.result(context) - resid, g, (tolerance(ggml_type)[0] + 1e-6, tolerance(ggml_type)[1] + 1e-6),
                      context + " +resid")  # fmt: skip
    assert (d_resid.to_host() == resid).all(), f"{context}: resid modified"
    results = []
    for _ in range(2):  # in place, twice: the same bits (a fixed order of the split sums; tickets left at zero)
        out = Output(n, rows, initial=resid)
        for launch in k_gemm_tc.gemm_dense(wg.dev, d_a, n, out.c, resid=out.c, slab=slab, split=split):
            launch()
        memory.synchronize(0)
        results.append(out.result(context + " in place"))
    assert (results[0] == results[1]).all(), f"{context}: two launches differ"

    out = Output(n, rows)
    for launch in k_gemm_tc.gemm_dense(wg.dev, d_a, n, out.c, up=wu.dev, slab=slab, split=split):
        launch()
    memory.synchronize(0)
    context = context.replace("gemm_dense", "gemm_dense swiglu")
    assert_rows_close(out.result(context), g / (1 + np.exp(-g)) * u, tolerance(ggml_type, swiglu=True), context)


# q/k/v through one slab: the Q4_K_M mix (Q4_K, Q4_K, Q6_K) and one type, with widths that put matrix boundaries
# inside 64-row tiles and inside slabs.
DENSE3_CASES = [((GGMLType.Q4_K, GGMLType.Q4_K, GGMLType.Q6_K), (130, (100, 36, 70), 256)),
                ((GGMLType.Q8_0, GGMLType.Q8_0, GGMLType.Q8_0), (300, (128, 64, 64), 96)),
                ((GGMLType.Q5_K, GGMLType.Q6_K), (129, (40, 24), 512))]  # fmt: skip


@pytest.mark.parametrize("split", [False, True], ids=["whole_k", "split_k"])
@pytest.mark.parametrize("case", DENSE3_CASES, ids=lambda c: "_".join(t.name for t in c[0]))
def test_gemm_dense3(case, split: bool, seed: int) -> None:
    needs_dense()
    types, (n, widths, cols) = case
    k_gemm.reserve()
    rng = np.random.default_rng(seed)
    ws = [Weight(rng, t, r, cols) for t, r in zip(types, widths, strict=True)]
    a = activations(rng, n, cols)
    d_a = DeviceArray.from_host(a)
    context = f"gemm_dense3 {[t.name for t in types]} n={n} R={widths} K={cols} split={split} seed={seed}"
    for slab_cols in (64, 128, sum(widths)):  # boundaries inside slabs, and one slab for all
        outs = [Output(n, r) for r in widths]
        slab = poisoned_slab(-(-slab_cols // 64) * 64 * cols)
        for launch in k_gemm_tc.gemm_dense3([w.dev for w in ws], d_a, n, [o.c for o in outs], slab=slab,
                                               split=split):  # fmt: skip
            launch()
        memory.synchronize(0)
        for m, (w, o) in enumerate(zip(ws, outs, strict=True)):
            where = f"{context} matrix {m} slab {slab_cols}"
            got = o.result(where)
            assert_rows_close(got, a.astype(np.float64) @ w.dense.T, tolerance(w.dev.ggml_type), where)
            if not split:
                alone = Output(n, widths[m])
                run(k_gemm.gemm(w.dev, d_a, n, alone.c, split=False))
                assert_rows_close(got, alone.result(where), AGAINST_GEMM, where + " against gemm")


@pytest.mark.parametrize("split", [False, True], ids=["whole_k", "split_k"])
@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=lambda s: "n{}_R{}_K{}".format(*s))
@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: t.name)
def test_gemm_pipe(ggml_type: GGMLType, shape: tuple[int, int, int], split: bool, seed: int) -> None:
    """gemm_pipe_{t} (the GGUF rows staged raw, dequantized beside the multiply): gemm's bounds, gemm_dense's bits and
    gemm's result (AGAINST_GEMM) unsplit, the residual forms, the same bits twice, and the SwiGLU pair."""
    needs_dense()
    n, rows, cols = shape
    needs_blocks(ggml_type, cols)
    k_gemm.reserve()
    wg, wu, a, resid = operands(np.random.default_rng(seed), ggml_type, n, rows, cols)
    d_a = DeviceArray.from_host(a)
    context = f"gemm_pipe {ggml_type.name} n={n} R={rows} K={cols} split={split} seed={seed}"
    a64 = a.astype(np.float64)
    g, u = a64 @ wg.dense.T, a64 @ wu.dense.T
    out = Output(n, rows)
    launch = k_gemm_tc.gemm_pipe(wg.dev, d_a, n, out.c, split=split)
    assert launch.block[0] == driver.block_limit(launch.fn), launch.block  # the block the kernel was built for
    assert launch.block[0] in k_gemm_tc.PIPE_THREADS, launch.block
    run(launch)
    got = out.result(context)
    assert_rows_close(got, g, tolerance(ggml_type), context)
    if not split:  # gemm_dense's instructions, operands and k order: its bits; gemm's roundings: its result, closely
        dense = Output(n, rows)
        for launch in k_gemm_tc.gemm_dense(wg.dev, d_a, n, dense.c, slab=poisoned_slab(64 * cols), split=False):
            launch()
        memory.synchronize(0)
        assert (got == dense.result(context)).all(), f"{context}: not gemm_dense's bits"
        whole = Output(n, rows)
        run(k_gemm.gemm(wg.dev, d_a, n, whole.c, split=False))
        assert_rows_close(got, whole.result(context), AGAINST_GEMM, context + " against gemm")
    results = []
    for _ in range(2):  # in place, twice
        out = Output(n, rows, initial=resid)
        run(k_gemm_tc.gemm_pipe(wg.dev, d_a, n, out.c, resid=out.c, split=split))
        results.append(out.result(context + " in place"))
    bound = (tolerance(ggml_type)[0] + 1e-6, tolerance(ggml_type)[1] + 1e-6)
    assert_rows_close(results[0] - resid, g, bound, context + " +resid")
    assert (results[0] == results[1]).all(), f"{context}: two launches differ"
    out = Output(n, rows)
    run(k_gemm_tc.gemm_pipe(wg.dev, d_a, n, out.c, up=wu.dev, split=split))
    context = context.replace("gemm_pipe", "gemm_pipe swiglu")
    assert_rows_close(out.result(context), g / (1 + np.exp(-g)) * u, tolerance(ggml_type, swiglu=True), context)


def test_gemm_tc_keeps_a_nan(seed: int) -> None:
    """A NaN activation makes its token's outputs NaN (and no other's) in gemm_dense and gemm_pipe, as in gemm: the
    logits' finiteness check must see it (a tf32 rounding by add-and-mask would turn the GPU's NaN, 0x7fffffff, into
    -0)."""
    needs_dense()
    rng = np.random.default_rng(seed)
    w = Weight(rng, GGMLType.Q4_K, 64, 256)
    a = activations(rng, 130, 256)
    a[3, 5] = np.uint32(0x7FFFFFFF).view(np.float32)
    d_a, c = DeviceArray.from_host(a), DeviceArray.empty((130, 64))
    for kind, launches in (("dense", k_gemm_tc.gemm_dense(w.dev, d_a, 130, c, slab=poisoned_slab(64 * 256))),
                           ("pipe", [k_gemm_tc.gemm_pipe(w.dev, d_a, 130, c)])):  # fmt: skip
        c.fill_byte(0)
        for launch in launches:
            launch()
        memory.synchronize(0)
        got = c.to_host().reshape(130, 64)
        assert np.isnan(got[3]).all(), f"{kind} seed {seed}: token 3's outputs {got[3][:8]}"
        assert np.isfinite(np.delete(got, 3, axis=0)).all(), f"{kind} seed {seed}: a NaN outside token 3"


def test_gemm_dense_checks(seed: int) -> None:
    needs_dense()
    rng = np.random.default_rng(seed)
    w, wu = Weight(rng, GGMLType.Q4_K, 64, 256), Weight(rng, GGMLType.Q4_K, 64, 256)
    a, c, slab = DeviceArray.empty((9, 256)), DeviceArray.empty((9, 64)), DeviceArray.empty((64 * 256,))
    k_gemm_tc.gemm_dense(w.dev, a, 9, c, slab=slab)  # the valid call
    with pytest.raises(CudaError, match="float32"):
        k_gemm_tc.gemm_dense(Weight(rng, GGMLType.F16, 64, 256).dev, a, 9, c, slab=slab)
    with pytest.raises(CudaError, match="no residual"):
        k_gemm_tc.gemm_dense(w.dev, a, 9, c, resid=c, up=wu.dev, slab=slab)
    with pytest.raises(CudaError, match="holds no"):
        k_gemm_tc.gemm_dense(w.dev, a, 9, c, slab=DeviceArray.empty((63 * 256,)))
    with pytest.raises(CudaError, match="differ"):
        k_gemm_tc.gemm_dense(w.dev, a, 9, c, up=Weight(rng, GGMLType.Q6_K, 64, 256).dev, slab=slab)
    with pytest.raises(CudaError, match="needs 2560"):
        k_gemm_tc.gemm_dense(w.dev, a, 10, c, slab=slab)
    with pytest.raises(CudaError, match="one width"):
        k_gemm_tc.gemm_dense3([w.dev, Weight(rng, GGMLType.Q4_K, 64, 512).dev], a, 9, [c, c], slab=slab)
    with pytest.raises(CudaError, match="1 to 3"):
        k_gemm_tc.gemm_dense3([w.dev] * 4, a, 9, [c] * 4, slab=slab)


def test_prefill_picks_the_gemm_by_the_rule(monkeypatch, seed: int) -> None:
    """prefill.matmul / swiglu / matmuls: REFLEX_PREFILL_GEMM's kernel from REFLEX_PREFILL_GEMM_MIN tokens on (sm_90;
    the dense one's slab reserved when it is named), gemm.cu below it and for float weights."""
    needs_dense()
    monkeypatch.setenv("REFLEX_PREFILL_GEMM_MIN", "100")
    rng = np.random.default_rng(seed)
    w, f = Weight(rng, GGMLType.Q8_0, 64, 256), Weight(rng, GGMLType.F32, 64, 256)
    a, c = DeviceArray.empty((100, 256)), DeviceArray.empty((100, 64))
    sm90 = driver.compute_major() >= 9  # dispatch.prefill_gemm's rule

    def names(launches) -> list[str]:
        return [launch.name for launch in launches]

    monkeypatch.setenv("REFLEX_PREFILL_GEMM", "dense")
    k_gemm.reserve()
    dense = ["gemm_tc.dequant_tf32_q8_0", "gemm_tc.gemm_dense"]
    assert names(prefill.matmul(w.dev, a, 100, c)) == (dense if sm90 else ["gemm.gemm_q8_0"])
    assert names(prefill.matmul(w.dev, a, 99, c)) == ["gemm.gemm_q8_0"]
    assert names(prefill.matmul(f.dev, a, 100, c)) == ["gemm.gemm_f32"]
    assert names(prefill.swiglu(w.dev, w.dev, a, 100, c)) == (dense if sm90 else ["gemm.gemm_swiglu_q8_0"])
    # q/k/v and a float matrix: the quantized ones three to a slab, the float one through gemm
    want = ["gemm.gemm_f32"] + ["gemm_tc.dequant_tf32_q8_0"] * 3 + ["gemm_tc.gemm_dense"] + dense
    got = names(prefill.matmuls([w.dev] * 4 + [f.dev], a, 100, [c] * 5))
    assert got == (want if sm90 else ["gemm.gemm_q8_0"] * 4 + ["gemm.gemm_f32"])

    monkeypatch.setenv("REFLEX_PREFILL_GEMM", "pipe")
    assert names(prefill.matmul(w.dev, a, 100, c)) == (["gemm_tc.gemm_pipe_q8_0"] if sm90 else ["gemm.gemm_q8_0"])
    assert names(prefill.swiglu(w.dev, w.dev, a, 100, c)) == (["gemm_tc.gemm_pipe_q8_0"] if sm90 else
                                                              ["gemm.gemm_swiglu_q8_0"])  # fmt: skip
    assert names(prefill.matmuls([w.dev, f.dev], a, 100, [c] * 2)) == (
        ["gemm_tc.gemm_pipe_q8_0", "gemm.gemm_f32"] if sm90 else ["gemm.gemm_q8_0", "gemm.gemm_f32"])  # fmt: skip

    monkeypatch.setenv("REFLEX_PREFILL_GEMM", "tile")
    assert names(prefill.matmul(w.dev, a, 100, c)) == ["gemm.gemm_q8_0"]
    monkeypatch.setenv("REFLEX_PREFILL_GEMM", "fast")
    with pytest.raises(InvalidInput, match="REFLEX_PREFILL_GEMM"):
        prefill.matmul(w.dev, a, 100, c)
