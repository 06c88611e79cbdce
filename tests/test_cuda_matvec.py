"""kernels/matvec.cu and kernels/embed.cu against NumPy float64 on the dequantized weights.

Fresh random inputs every run; the seed is in every failure message and MATVEC_SEED=<seed> replays it. Outputs are
poisoned (0xFF bytes: NaN) first, so an unwritten element fails, and slack past the needed size must stay poisoned.
Weights, inputs and exact-size outputs are allocated to the byte, so compute-sanitizer sees any overrun.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from engine.cuda import dispatch, driver, k_embed, k_matvec, memory
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.errors import CudaError
from engine.quants import KERNEL_TAGS, GGMLType
from tests.cuda_util import Weight, cuda_context, needs_blocks  # noqa: F401 - cuda_context: autouse fixture
from tests.i16 import rounded

pytestmark = pytest.mark.gpu

TYPES = sorted(KERNEL_TAGS)  # the types the kernels compute
# (R, K): R never a multiple of 8 except 1024 rows; K from one block to a Qwen-size ffn_down (11008 = 43 * 256).
# K = 3072: rows too wide to stage yet within the sub-block form's 4096 (matvec_block.cuh).
SHAPES = [(1, 32), (13, 256), (29, 3072), (67, 4352), (37, 11008), (1003, 1024)]
RTOL = 1e-5  # of sum |w * x| over the row: float32 accumulation of up to ~11k products
POISON = 0xFFFFFFFF


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MATVEC_SEED") or np.random.default_rng().integers(2**63))


def poisoned(shape: tuple[int, ...]) -> DeviceArray:
    a = DeviceArray.empty(shape, "f4")
    a.fill_byte(0xFF)
    return a


def run(launch: driver.Launch) -> None:
    launch()
    memory.synchronize(0)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """(n, K) f64 -> (n, K) f64."""
    return x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * w


def dotted_x(x: np.ndarray, norm_w: np.ndarray, eps: float, norm: bool, i16: bool) -> np.ndarray:
    """(n, K) f32 -> the x a kernel dots with, f64: rmsnorm(x) (or x); for a 16-bit form (i16) x times norm_w in
    float32 rounded as tests/i16.py rounds it, then times the rsqrt scale, as the kernel applies it last."""
    if not i16:
        return rmsnorm(x.astype(np.float64), norm_w, eps) if norm else x.astype(np.float64)
    s = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + eps) if norm else 1.0
    return rounded(x * norm_w if norm else x) * s


def i16_forms(n: int, *types: GGMLType) -> list[bool]:
    """The forms a launch of n tokens over these types has: the float one, and for one token of k_matvec.I16_TYPES
    the 16-bit one (REFLEX_MATVEC_I16)."""
    return [False, True] if n == 1 and all(t in k_matvec.I16_TYPES for t in types) else [False]


def assert_close(got: np.ndarray, ref: np.ndarray, tol: np.ndarray, context: str) -> None:
    assert not np.isnan(got).any(), f"{context}: unwritten (NaN) outputs at {np.argwhere(np.isnan(got))[:8].tolist()}"
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), (
        f"{context}: {(err > tol).sum()} of {err.size} outside tolerance; worst at {worst}: got {got[worst]!r}, "
        f"want {ref[worst]!r}, error {err[worst]:.3g} > {tol[worst]:.3g}"
    )


def swiglu_reference(xn: np.ndarray, wg: np.ndarray, wu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """silu(xn . wg^T) * (xn . wu^T) (n, R) f64 and its tolerance: |d silu / dg| <= 1.1, so silu(g) * u carries each
    dot product's float32 error (RTOL) and one float32 rounding per step."""
    g, u = xn @ wg.T, xn @ wu.T  # (n, R)
    silu = g / (1 + np.exp(-g))
    ref = silu * u
    tol_g, tol_u = RTOL * (np.abs(xn) @ np.abs(wg).T), RTOL * (np.abs(xn) @ np.abs(wu).T)
    return ref, 1.1 * np.abs(u) * tol_g + np.abs(silu) * tol_u + 1e-6 * np.abs(ref) + 1e-30


def assert_untouched(host: np.ndarray, context: str) -> None:
    assert (host.view(np.uint32) == POISON).all(), f"{context}: written past the outputs"


def inputs(rng: np.random.Generator, n: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Activations (n, cols) and a norm weight (cols,), f32, O(1) like a model's."""
    x = rng.normal(size=(n, cols)).astype(np.float32)
    norm_w = (1.0 + 0.2 * rng.normal(size=cols)).astype(np.float32)
    return x, norm_w


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matvec(ggml_type: GGMLType, shape: tuple[int, int], n: int, seed: int, monkeypatch) -> None:
    """Every type and token count, with and without the fused RMSNorm and the in-place residual; one token of
    k_matvec.I16_TYPES in both forms (the 16-bit one against the rounded x)."""
    rows, cols = shape
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    w = Weight(rng, ggml_type, rows, cols)
    x, norm_w = inputs(rng, n, cols)
    resid = rng.normal(size=(n, rows)).astype(np.float32)
    eps = 1e-6
    d_x, d_norm = DeviceArray.from_host(x), DeviceArray.from_host(norm_w)
    big_n = k_matvec._bucket(n, ggml_type)
    for i16, norm in itertools.product(i16_forms(n, ggml_type), (False, True)):
        monkeypatch.setenv("REFLEX_MATVEC_I16", "1" if i16 else "0")
        xn = dotted_x(x, norm_w, eps, norm, i16)
        ref = xn @ w.dense.T  # (n, rows)
        tol = RTOL * (np.abs(xn) @ np.abs(w.dense).T) + 1e-30
        context = f"{ggml_type.name} {rows}x{cols} n={n} norm={norm} i16={i16} seed={seed}"

        y = poisoned((big_n, rows))  # rows of tokens n..big_n-1 must stay untouched
        launch = k_matvec.matvec(w.dev, d_x, n, y, norm_w=d_norm if norm else None, eps=eps)
        assert launch.name.startswith("matvec.matvec16_" if i16 else "matvec.matvec_"), launch.name
        run(launch)
        got = y.to_host()
        assert_close(got[:n], ref, tol, context)
        assert_untouched(got[n:], context)

        y_res = DeviceArray.from_host(resid)  # in-place residual add: resid is y
        run(k_matvec.matvec(w.dev, d_x, n, y_res, norm_w=d_norm if norm else None, eps=eps, resid=y_res))
        assert_close(y_res.to_host(), resid + ref, tol + 1e-7 * np.abs(resid), context + " resid=y")


# matvec_stream: rows not a multiple of a warp's 16 or a block's 64 (and fewer than one block's), K up to its 2048.
# Both kernels: K <= 1024 (_k1024) and the wider one.
STREAM_SHAPES = [(5, 256), (77, 1024), (1003, 2048), (130, 32), (50, 1536)]


def check_stream(ggml_type: GGMLType, shape: tuple[int, int], seed: int, form: str) -> None:
    """matvec_stream (form "stream": float dots) or matvec_stream16 ("stream16": x times norm_w rounded to 16 bits a
    group of 8 as tests/i16.py rounds it, the float tolerance of the rounded-x product), forced on small matrices: with
    and without the fused RMSNorm and the in-place residual; the slack past R stays poisoned."""
    rows, cols = shape
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    w = Weight(rng, ggml_type, rows, cols)
    x, norm_w = inputs(rng, 1, cols)
    resid = rng.normal(size=(1, rows)).astype(np.float32)
    eps = 1e-6
    d_x, d_norm = DeviceArray.from_host(x), DeviceArray.from_host(norm_w)
    for norm in (False, True):
        launch = k_matvec.matvec(w.dev, d_x, 1, poisoned((1, rows)), norm_w=d_norm if norm else None, stream=True)
        assert launch.name.startswith(f"matvec.matvec_{form}_"), launch.name
        xn = dotted_x(x, norm_w, eps, norm, form == "stream16")
        ref = xn @ w.dense.T
        tol = RTOL * (np.abs(xn) @ np.abs(w.dense).T) + 1e-30
        context = f"{form} {ggml_type.name} {rows}x{cols} norm={norm} seed={seed}"
        y = poisoned((1, rows + 40))
        run(k_matvec.matvec(w.dev, d_x, 1, y, norm_w=d_norm if norm else None, eps=eps, stream=True))
        got = y.to_host()
        assert_close(got[:, :rows], ref, tol, context)
        assert_untouched(got[:, rows:], context)
        y_res = DeviceArray.from_host(resid)
        run(k_matvec.matvec(w.dev, d_x, 1, y_res, norm_w=d_norm if norm else None, eps=eps, resid=y_res, stream=True))
        assert_close(y_res.to_host(), resid + ref, tol + 1e-7 * np.abs(resid), context + " resid=y")


@pytest.mark.parametrize("shape", STREAM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("ggml_type", sorted(k_matvec.STREAM_TYPES), ids=lambda t: t.name)
def test_matvec_stream(ggml_type: GGMLType, shape: tuple[int, int], seed: int, monkeypatch) -> None:
    """The streamed one-token matvec (the LM head's), its float form (REFLEX_STREAM_I16=0)."""
    monkeypatch.setenv("REFLEX_STREAM_I16", "0")
    check_stream(ggml_type, shape, seed, "stream")


@pytest.mark.parametrize("shape", STREAM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("ggml_type", sorted(k_matvec.STREAM16_TYPES), ids=lambda t: t.name)
def test_matvec_stream16(ggml_type: GGMLType, shape: tuple[int, int], seed: int) -> None:
    """Its integer form, the default for k_matvec.STREAM16_TYPES."""
    check_stream(ggml_type, shape, seed, "stream16")


def test_matvec_stream_choice() -> None:
    """The LM head shapes take matvec_stream; other matvecs, several tokens, wide rows and other types do not."""
    assert dispatch.use_stream(151936, 1024, 1) and dispatch.use_stream(248320, 2048, 1)
    assert not dispatch.use_stream(151936, 1024, 2) and not dispatch.use_stream(151936, 4096, 1)
    assert not dispatch.use_stream(3072, 1024, 1)
    assert GGMLType.F32 not in k_matvec.STREAM_TYPES and GGMLType.IQ4_XS not in k_matvec.STREAM_TYPES


def test_matvec_stream_refuses() -> None:
    rng = np.random.default_rng(0)
    w = Weight(rng, GGMLType.F32, 8, 64)
    x = DeviceArray.from_host(np.zeros((2, 64), np.float32))
    with pytest.raises(CudaError, match="matvec_stream"):
        k_matvec.matvec(w.dev, x, 1, poisoned((1, 8)), stream=True)


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("shape", SHAPES[1:5], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matvec_swiglu(ggml_type: GGMLType, shape: tuple[int, int], n: int, seed: int, monkeypatch) -> None:
    rows, cols = shape
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    wg, wu = Weight(rng, ggml_type, rows, cols), Weight(rng, ggml_type, rows, cols)
    x, norm_w = inputs(rng, n, cols)
    eps = 1e-5
    d_x, d_norm = DeviceArray.from_host(x), DeviceArray.from_host(norm_w)
    for i16, norm in itertools.product(i16_forms(n, ggml_type), (False, True)):
        monkeypatch.setenv("REFLEX_MATVEC_I16", "1" if i16 else "0")
        xn = dotted_x(x, norm_w, eps, norm, i16)
        ref, tol = swiglu_reference(xn, wg.dense, wu.dense)
        y = poisoned((n * rows + 7,))  # 7 floats of slack must stay untouched
        launch = k_matvec.matvec_swiglu(wg.dev, wu.dev, d_x, n, y, norm_w=d_norm if norm else None, eps=eps)
        assert launch.name.startswith("matvec.matvec_swiglu16_" if i16 else "matvec.matvec_swiglu_"), launch.name
        run(launch)
        got = y.to_host()
        context = f"{ggml_type.name} {rows}x{cols} n={n} norm={norm} i16={i16} seed={seed}"
        assert_close(got[: n * rows].reshape(n, rows), ref, tol, context)
        assert_untouched(got[n * rows :], context)


MATVEC3_CASES = [(t, t) for t in TYPES if k_matvec.has_matvec3(t)] + sorted(k_matvec.MATVEC3_PAIRS)


@pytest.mark.parametrize(
    "rows", [(13,), (1024, 67), (4096, 512, 512), (1, 9, 130)], ids=lambda r: "+".join(map(str, r))
)
@pytest.mark.parametrize("cols", [256, 2048, 3072])
@pytest.mark.parametrize("i16", [True, False], ids=["i16", "float"])
@pytest.mark.parametrize("types", MATVEC3_CASES, ids=lambda t: "+".join(sorted({t[0].name, t[1].name})))
def test_matvec3(
    types: tuple[GGMLType, GGMLType], i16: bool, cols: int, rows: tuple[int, ...], seed: int, monkeypatch
) -> None:
    """One token through up to three matrices in one launch (one type, or two of a and one of b; the 16-bit form
    where the types have it): against NumPy, and bit for bit equal to one matvec launch per matrix (of the same
    form); every output exactly its size (slack after each stays poisoned)."""
    a, b = types
    if a != b and len(rows) < 3:
        pytest.skip("a pair of types takes three matrices")
    if i16 and i16 not in i16_forms(1, a, b):
        pytest.skip("no 16-bit form for these types")
    monkeypatch.setenv("REFLEX_MATVEC_I16", "1" if i16 else "0")
    rng = np.random.default_rng(seed)
    ws = [Weight(rng, a if m < 2 else b, r, cols) for m, r in enumerate(rows)]
    x, norm_w = inputs(rng, 1, cols)
    d_x, d_norm = DeviceArray.from_host(x), DeviceArray.from_host(norm_w)
    xn = dotted_x(x, norm_w, 1e-6, True, i16)
    ys = [poisoned((r + 5,)) for r in rows]
    launch = k_matvec.matvec3([w.dev for w in ws], d_x, ys, norm_w=d_norm, eps=1e-6)
    assert launch.name.startswith("matvec.matvec3_16_" if i16 else "matvec.matvec3_"), launch.name
    assert i16 or not launch.name.startswith("matvec.matvec3_16_"), launch.name
    run(launch)
    for m, (w, y) in enumerate(zip(ws, ys, strict=True)):
        context = f"{w.dev.tag} rows={rows} K={cols} {launch.name} matrix {m} seed={seed}"
        got = y.to_host()
        tol = RTOL * (np.abs(xn) @ np.abs(w.dense).T) + 1e-30
        assert_close(got[None, : w.dev.rows], xn @ w.dense.T, tol, context)
        assert_untouched(got[w.dev.rows :], context)
        alone = poisoned((w.dev.rows,))
        run(k_matvec.matvec(w.dev, d_x, 1, alone, norm_w=d_norm, eps=1e-6))
        np.testing.assert_array_equal(got[: w.dev.rows], alone.to_host(), err_msg=context + ": differs from matvec")


def test_matvec3_rejects_mixed_matrices() -> None:
    w = DeviceWeight(0x1000, GGMLType.Q4_K, 16, 256, 144, "w")
    v6 = DeviceWeight(0x1000, GGMLType.Q6_K, 16, 256, 210, "v")
    x, y = DeviceArray(0x2000, (1, 256), "f4", False), DeviceArray(0x3000, (1, 16), "f4", False)
    with pytest.raises(CudaError, match="one width"):
        k_matvec.matvec3([w, v6], x, [y, y])  # a pair of types takes three matrices
    with pytest.raises(CudaError, match="one width"):
        k_matvec.matvec3([w, v6, w], x, [y, y, y])  # b last
    with pytest.raises(CudaError, match="one width"):
        k_matvec.matvec3([w, DeviceWeight(0x1000, GGMLType.Q4_K, 16, 512, 288, "v")], x, [y, y])
    with pytest.raises(CudaError, match="1 to 3 matrices"):
        k_matvec.matvec3([w] * 4, x, [y] * 4)
    with pytest.raises(CudaError, match="y: needs"):
        k_matvec.matvec3([w], x, [DeviceArray(0x3000, (1, 8), "f4", False)])


@pytest.mark.parametrize(
    ("cols", "n"), [(512, 3), (2048, 3), (2048, 6), (2048, 1)], ids=["K512-n3", "K2048-n3", "K2048-n6", "K2048-n1"]
)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matvec_exact_buffers(ggml_type: GGMLType, cols: int, n: int, seed: int) -> None:
    """Every buffer exactly its needed size, a partial last block (13 rows), n below the kernel's N, all options on,
    rows split between two slices of threads (K=512) or not: under compute-sanitizer, any read past a tensor's tail
    or a token's row is reported."""
    rows = 13
    rng = np.random.default_rng(seed)
    w = Weight(rng, ggml_type, rows, cols)
    wu = Weight(rng, ggml_type, rows, cols)
    x, norm_w = inputs(rng, n, cols)
    resid = rng.normal(size=(n, rows)).astype(np.float32)
    d_x, d_norm, d_resid = DeviceArray.from_host(x), DeviceArray.from_host(norm_w), DeviceArray.from_host(resid)
    xn = dotted_x(x, norm_w, 1e-6, True, i16_forms(n, ggml_type)[-1] and dispatch.matvec_i16())
    y = poisoned((n, rows))
    run(k_matvec.matvec(w.dev, d_x, n, y, norm_w=d_norm, eps=1e-6, resid=d_resid))
    tol = RTOL * (np.abs(xn) @ np.abs(w.dense).T) + 1e-7 * np.abs(resid)
    assert_close(y.to_host(), resid + xn @ w.dense.T, tol, f"{ggml_type.name} K={cols} n={n} seed={seed}")
    y2 = poisoned((n, rows))
    run(k_matvec.matvec_swiglu(w.dev, wu.dev, d_x, n, y2, norm_w=d_norm, eps=1e-6))
    assert not np.isnan(y2.to_host()).any(), f"{ggml_type.name} K={cols} n={n} swiglu seed={seed}: unwritten outputs"


@pytest.mark.parametrize("x_stride_pad", [None, 0, 36], ids=["shared_x", "packed_x", "padded_x"])
@pytest.mark.parametrize("cols", [32, 256, 4352])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gather_dot(ggml_type: GGMLType, cols: int, x_stride_pad: int | None, seed: int) -> None:
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    n_rows, n = 29, 13  # 13 outputs: a partial second block of warps
    w = Weight(rng, ggml_type, n_rows, cols)
    rows = rng.integers(0, n_rows, size=n).astype(np.int32)
    rows[[1, 4, 7]] = [n_rows - 1, 0, rows[0]]  # the last and first rows, a repeat; otherwise unordered
    x_stride = 0 if x_stride_pad is None else cols + x_stride_pad
    x_all = rng.normal(size=(n - 1) * x_stride + cols).astype(np.float32)  # exactly the floats needed
    xs = np.stack([x_all[i * x_stride : i * x_stride + cols] for i in range(n)]).astype(np.float64)  # (n, cols)
    ref = np.einsum("ik,ik->i", w.dense[rows], xs)
    tol = RTOL * np.einsum("ik,ik->i", np.abs(w.dense[rows]), np.abs(xs)) + 1e-30
    out = poisoned((n + 3,))
    run(k_matvec.gather_dot(w.dev, DeviceArray.from_host(x_all), x_stride, DeviceArray.from_host(rows), n, out))
    got = out.to_host()
    context = f"{ggml_type.name} K={cols} x_stride={x_stride} rows={rows.tolist()} seed={seed}"
    assert_close(got[:n], ref, tol, context)
    assert_untouched(got[n:], context)


@pytest.mark.parametrize("cols", [32, 256, 4352])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_embed(ggml_type: GGMLType, cols: int, seed: int) -> None:
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    n_vocab, n = 37, 11
    w = Weight(rng, ggml_type, n_vocab, cols)
    ids = rng.integers(0, n_vocab, size=n).astype(np.int32)
    ids[[2, 5, 9]] = [n_vocab - 1, 0, ids[0]]  # the last and first rows, a repeat
    out = poisoned((n + 1, cols))
    run(k_embed.embed(w.dev, DeviceArray.from_host(ids), n, out))
    got = out.to_host()
    context = f"{ggml_type.name} K={cols} ids={ids.tolist()} seed={seed}"
    # load8 is exact in float32, as is the NumPy decoder: the rows must match bit for bit (up to the sign of 0).
    assert np.array_equal(got[:n], w.dense[ids].astype(np.float32)), context
    assert_untouched(got[n:], context)


def test_wrappers_reject_bad_buffers() -> None:
    w = DeviceWeight(0x1000, GGMLType.Q4_K, 16, 256, 144, "w")
    x, y = DeviceArray(0x2000, (2, 256), "f4", False), DeviceArray(0x3000, (2, 16), "f4", False)
    with pytest.raises(CudaError, match="1 to 8 tokens"):
        k_matvec.matvec(w, x, 9, y)
    with pytest.raises(CudaError, match="1 to 8 tokens"):
        k_matvec.matvec(w, x, 0, y)
    with pytest.raises(CudaError, match="x: needs 768"):
        k_matvec.matvec(w, x, 3, DeviceArray(0x3000, (3, 16), "f4", False))
    with pytest.raises(CudaError, match="y: needs"):
        k_matvec.matvec(w, x, 2, DeviceArray(0x3000, (2, 16), "i4", False))
    with pytest.raises(CudaError, match="aligned"):
        k_matvec.matvec(w, DeviceArray(0x2004, (2, 256), "f4", False), 2, y)
    with pytest.raises(CudaError, match="x_stride"):
        k_matvec.gather_dot(w, x, 6, DeviceArray(0x4000, (2,), "i4", False), 2, y)
    with pytest.raises(CudaError, match="swiglu weights differ"):
        k_matvec.matvec_swiglu(w, DeviceWeight(0x1000, GGMLType.Q6_K, 16, 256, 210, "u"), x, 1, y)


@pytest.mark.parametrize(
    "name", ["qwen3-tiny-q8_0", "qwen3-tiny-q4_k_m", "qwen35-tiny-q8_0", "qwen3moe-tiny-q8_0", "deepseek2-tiny-q8_0"]
)
def test_every_one_token_matvec_streamed_matches_the_cpu_backend(name: str, monkeypatch) -> None:
    """With dispatch.STREAM_MIN_ROWS at 1, every one-token matvec of a stream type and K <= 2048 (the projections as
    well as the LM head, whose fixtures are too small for the real rule) takes matvec_stream: a model's decode steps
    still match the CPU backend as closely as the block matvec's do (1e-4 of the largest logit). The other 1-token
    kernels take their float forms here (REFLEX_MATVEC_I16=0): their 16-bit forms round x (tests above), and the
    model tests hold them to docs/design.md's quantized-file tolerance against llama.cpp's fixtures instead."""
    from engine.engine import Engine
    from tests import conformance

    monkeypatch.setenv("REFLEX_MATVEC_I16", "0")
    monkeypatch.setattr(dispatch, "STREAM_MIN_ROWS", 1)
    chosen: list[bool] = []
    rule = dispatch.use_stream
    monkeypatch.setattr(dispatch, "use_stream", lambda rows, cols, n: chosen.append(rule(rows, cols, n)) or chosen[-1])
    path = conformance.fixture_path(name, ".gguf")
    cpu = Engine.load(path, backend="cpu", max_seq_len=64)
    cuda = Engine.load(path, backend="cuda", max_seq_len=64)
    assert cuda.backend == "cuda"
    ids = [998, 12, 400, 77, 531, 9, 250, 868, 33, 101]
    want, got = cpu.logits(ids, prefill=1), cuda.logits(ids, prefill=1)
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= 1e-4 * scale, name
    assert any(chosen), f"{name}: no matvec took matvec_stream"
