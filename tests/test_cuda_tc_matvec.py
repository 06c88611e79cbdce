"""kernels/tc_matvec.cu (small batches on tensor cores) against NumPy float64 on the dequantized weights, held to the
float32 matvec's bound (1e-5 of sum |w * x| a row): the split-f16 operands are meant to leave nothing of f16's
rounding in the sums.

Fresh random inputs every run; the seed is in every failure message and TC_SEED=<seed> replays it. Outputs are
poisoned (0xFF bytes: NaN) first, so an unwritten element fails, and rows of tokens past n must stay poisoned.
Weights and inputs are allocated to the byte, so compute-sanitizer sees any overrun.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.cuda import k_matvec, k_tc_matvec
from engine.cuda.memory import DeviceArray
from engine.errors import CudaError
from engine.quants import GGMLType
from tests.cuda_util import Weight, cuda_context, needs_blocks  # noqa: F401 - cuda_context: autouse fixture
from tests.quant_data import random_weights
from tests.test_cuda_matvec import (
    RTOL,
    assert_close,
    assert_untouched,
    inputs,
    poisoned,
    rmsnorm,
    run,
    swiglu_reference,
)

pytestmark = pytest.mark.gpu

TYPES = sorted(k_tc_matvec.TYPES)
# (n, R, K): n at and past each token tile (16, 32, 64) and at the smallest batch the engine sends; R not a multiple
# of the block's 8 rows (and below it); K from one K-quant block to past the staged width (2048: 3072 and 4352 are
# read from global memory) and a 32-value-block width (96) that no K-quant has.
SHAPES = [(9, 13, 256), (16, 1003, 1024), (17, 67, 2048), (33, 5, 3072), (64, 40, 4352), (48, 24, 96)]


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("TC_SEED") or np.random.default_rng().integers(2**63))


def check(got: np.ndarray, n: int, ref: np.ndarray, tol: np.ndarray, context: str) -> None:
    assert_close(got[:n], ref, tol, context)
    assert_untouched(got[n:], context)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}_R{}_K{}".format(*s))
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_tcmv(ggml_type: GGMLType, shape: tuple[int, int, int], seed: int) -> None:
    n, rows, cols = shape
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    w = Weight(rng, ggml_type, rows, cols)
    x, norm_w = inputs(rng, n, cols)
    resid = rng.normal(size=(n, rows)).astype(np.float32)
    eps = 1e-6
    d_x, d_norm = DeviceArray.from_host(x), DeviceArray.from_host(norm_w)
    for norm in (False, True):
        xn = rmsnorm(x.astype(np.float64), norm_w, eps) if norm else x.astype(np.float64)
        ref = xn @ w.dense.T  # (n, rows)
        tol = RTOL * (np.abs(xn) @ np.abs(w.dense).T) + 1e-30
        context = f"tcmv {ggml_type.name} n={n} R={rows} K={cols} norm={norm} seed={seed}"

        y = poisoned((k_tc_matvec.MAX_TOKENS, rows))
        run(k_tc_matvec.tcmv(w.dev, d_x, n, y, norm_w=d_norm if norm else None, eps=eps))
        check(y.to_host(), n, ref, tol, context)

        y_res = DeviceArray.from_host(resid)  # in-place residual add: resid is y
        run(k_tc_matvec.tcmv(w.dev, d_x, n, y_res, norm_w=d_norm if norm else None, eps=eps, resid=y_res))
        assert_close(y_res.to_host(), resid + ref, tol + 1e-7 * np.abs(resid), context + " resid=y")


# Blocks of 16 rows at 16 and 32 tokens (R = 13, 37: a partial one), which stage rows of up to 1024 values (2304:
# read from global memory); 8 rows at 64.
SWIGLU_SHAPES = [(9, 13, 256), (32, 100, 1024), (17, 37, 2304), (64, 19, 3072)]


@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=lambda s: "n{}_R{}_K{}".format(*s))
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_tcmv_swiglu(ggml_type: GGMLType, shape: tuple[int, int, int], seed: int) -> None:
    n, rows, cols = shape
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    wg, wu = Weight(rng, ggml_type, rows, cols), Weight(rng, ggml_type, rows, cols)
    x, norm_w = inputs(rng, n, cols)
    eps = 1e-6
    d_x, d_norm = DeviceArray.from_host(x), DeviceArray.from_host(norm_w)
    for norm in (False, True):
        xn = rmsnorm(x.astype(np.float64), norm_w, eps) if norm else x.astype(np.float64)
        ref, tol = swiglu_reference(xn, wg.dense, wu.dense)  # the float32 matvec's bound
        context = f"tcmv_swiglu {ggml_type.name} n={n} R={rows} K={cols} norm={norm} seed={seed}"
        y = poisoned((k_tc_matvec.MAX_TOKENS, rows))
        run(k_tc_matvec.tcmv_swiglu(wg.dev, wu.dev, d_x, n, y, norm_w=d_norm if norm else None, eps=eps))
        check(y.to_host(), n, ref, tol, context)


TCMV3_TYPES = [(t, t) for t in TYPES] + sorted(k_matvec.MATVEC3_PAIRS)


@pytest.mark.parametrize(("n", "cols", "rows"), [(9, 256, (13, 5, 5)), (16, 1024, (2048, 1024, 1024)),
                                                 (20, 1536, (40, 24, 8)), (33, 3072, (24, 8)),
                                                 (64, 512, (7,))])  # fmt: skip
@pytest.mark.parametrize("types", TCMV3_TYPES, ids=lambda p: "_".join(t.name for t in p))
def test_tcmv3(types: tuple[GGMLType, GGMLType], n: int, cols: int, rows: tuple[int, ...], seed: int) -> None:
    """A small batch through up to three matrices in one launch (one type, or two of a and one of b): against NumPy,
    and bit for bit equal to a tcmv3 launch of each matrix alone; outputs exactly their size (the slack stays
    poisoned). (tcmv splits K among 32 or 16 warps, tcmv3 among 8: the two agree to float32 rounding, each held to
    NumPy.)"""
    a, b = types
    if a != b and len(rows) < 3:
        pytest.skip("a pair of types takes three matrices")
    needs_blocks(a, cols)
    needs_blocks(b, cols)
    rng = np.random.default_rng(seed)
    ws = [Weight(rng, a if m < 2 else b, r, cols) for m, r in enumerate(rows)]
    x, norm_w = inputs(rng, n, cols)
    d_x, d_norm = DeviceArray.from_host(x), DeviceArray.from_host(norm_w)
    xn = rmsnorm(x.astype(np.float64), norm_w, 1e-6)
    ys = [poisoned((n * r + 5,)) for r in rows]
    launch = k_tc_matvec.tcmv3([w.dev for w in ws], d_x, n, ys, norm_w=d_norm, eps=1e-6)
    run(launch)
    for m, (w, y) in enumerate(zip(ws, ys, strict=True)):
        context = f"{w.dev.tag} n={n} rows={rows} K={cols} {launch.name} matrix {m} seed={seed}"
        got = y.to_host()
        tol = RTOL * (np.abs(xn) @ np.abs(w.dense).T) + 1e-30
        assert_close(got[: n * w.dev.rows].reshape(n, w.dev.rows), xn @ w.dense.T, tol, context)
        assert_untouched(got[n * w.dev.rows :], context)
        alone = poisoned((n, w.dev.rows))
        run(k_tc_matvec.tcmv3([w.dev], d_x, n, [alone], norm_w=d_norm, eps=1e-6))
        np.testing.assert_array_equal(got[: n * w.dev.rows], alone.to_host().ravel(), err_msg=context + ": differs")


def test_tcmv3_refuses_what_it_cannot_compute() -> None:
    rng = np.random.default_rng(0)
    q4, q6 = Weight(rng, GGMLType.Q4_K, 8, 256), Weight(rng, GGMLType.Q6_K, 8, 256)
    f32 = Weight(rng, GGMLType.F32, 8, 256)
    x, y = DeviceArray.empty((16, 256)), DeviceArray.empty((16, 8))
    with pytest.raises(CudaError, match="one width"):
        k_tc_matvec.tcmv3([q4.dev, q6.dev, q4.dev], x, 16, [y, y, y])  # b last
    with pytest.raises(CudaError, match="tc_matvec's types"):
        k_tc_matvec.tcmv3([f32.dev], x, 16, [y])
    with pytest.raises(CudaError, match="1 to 3 matrices"):
        k_tc_matvec.tcmv3([q4.dev] * 4, x, 16, [y] * 4)
    with pytest.raises(CudaError, match="1 to 64 tokens"):
        k_tc_matvec.tcmv3([q4.dev], DeviceArray.empty((65, 256)), 65, [DeviceArray.empty((65, 8))])


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_tcmv_wide_range(ggml_type: GGMLType, seed: int) -> None:
    """Activations far outside f16's range (1e6) beside tiny ones (1e-6) in the same 32-value chunks, and a token of
    zeros: the per-chunk power-of-two scale keeps every product at float32 accuracy and nothing overflows."""
    n, rows, cols = 20, 29, 512
    rng = np.random.default_rng(seed)
    w = Weight(rng, ggml_type, rows, cols)
    x = rng.normal(size=(n, cols)) * 10.0 ** rng.integers(-6, 7, size=(n, cols))  # (n, cols): 1e-6 .. 1e6
    x[3] = 0.0
    x = x.astype(np.float32)
    ref = x.astype(np.float64) @ w.dense.T
    tol = RTOL * (np.abs(x.astype(np.float64)) @ np.abs(w.dense).T) + 1e-30
    y = poisoned((n, rows))
    d_x = DeviceArray.from_host(x)
    run(k_tc_matvec.tcmv(w.dev, d_x, n, y))
    assert_close(y.to_host(), ref, tol, f"tcmv wide range {ggml_type.name} seed={seed}")


def cancelling_q4_k(rng: np.random.Generator, rows: int, cols: int) -> Weight:
    """A Q4_K matrix whose every sub-block has d = dmin, scale 1 and min 8: w = d (q - 8), exactly zero where q = 8
    (d * sc * q and dmin * m cancel)."""
    blocks = random_weights(rng, GGMLType.Q4_K, (rows, cols)).reshape(-1, 144)  # (rows * cols / 256, 144) u1
    blocks[:, 0:4] = np.tile(np.array([0.01], np.float16).view(np.uint8), 2)  # d, dmin
    blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16] = 1, 8, 1 | 8 << 4  # sc 1, m 8 in all eight sub-blocks
    return Weight(rng, GGMLType.Q4_K, rows, cols, raw=blocks.reshape(-1))


@pytest.mark.parametrize("n", [13, 32])
def test_tcmv_holds_the_bound_where_weights_cancel_to_zero(n: int, seed: int) -> None:
    """Weights that are zero only because a scale times a quant cancels a min, under an activation of 1e6: the sums
    must follow |w * x| (a form that multiplies scale and min out separately would leave ~1e6 * 2^-24 there)."""
    rows, cols = 24, 1024
    rng = np.random.default_rng(seed)
    w = cancelling_q4_k(rng, rows, cols)
    zeros = np.flatnonzero(w.dense[0] == 0.0)
    assert zeros.size, "no cancelling weight drawn"
    x = rng.normal(size=(n, cols))
    x[:, rng.choice(zeros, size=min(4, zeros.size), replace=False)] = 1e6
    x = x.astype(np.float32)
    ref = x.astype(np.float64) @ w.dense.T
    tol = RTOL * (np.abs(x.astype(np.float64)) @ np.abs(w.dense).T) + 1e-30
    y = poisoned((n, rows))
    run(k_tc_matvec.tcmv(w.dev, DeviceArray.from_host(x), n, y))
    assert_close(y.to_host(), ref, tol, f"tcmv cancelling Q4_K n={n} seed={seed}")


def test_tcmv_refuses_what_it_cannot_compute() -> None:
    rng = np.random.default_rng(0)
    q4 = Weight(rng, GGMLType.Q4_K, 8, 256)
    f32 = Weight(rng, GGMLType.F32, 8, 256)
    x = DeviceArray.empty((65, 256))
    y = DeviceArray.empty((65, 8))
    with pytest.raises(CudaError, match="1 to 64 tokens"):
        k_tc_matvec.tcmv(q4.dev, x, 65, y)
    with pytest.raises(CudaError, match="no kernel"):
        k_tc_matvec.tcmv(f32.dev, x, 16, y)
    with pytest.raises(CudaError, match="x: needs"):
        k_tc_matvec.tcmv(q4.dev, DeviceArray.empty((8, 256)), 16, y)
