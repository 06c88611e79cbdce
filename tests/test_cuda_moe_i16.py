"""kernels/moe.cu's 16-bit expert forms (moe_gate_up16, moe_down16; kernels/quant_i16.cuh) against NumPy: the
activations rounded as the kernels round them (tests/i16.py), every type they take, awkward widths, the shared
expert alongside, NaN, and what the wrappers refuse. Fresh random inputs; MOE_SEED=<seed> replays a failure; outputs
poisoned first. MoEFFN end to end with these forms: tests/test_cuda_moe.py's test_moe_ffn."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.cuda import k_moe
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.errors import CudaError
from engine.quants import GGMLType, row_bytes
from tests.cuda_util import cuda_context, needs_blocks  # noqa: F401 - cuda_context: autouse fixture
from tests.i16 import HALF_STEP, round16, rounded
from tests.test_cuda_moe import (
    RTOL,
    SMALL,
    Stack,
    activations,
    poisoned,
    routed_ids,
    run,
    swiglu_ref,
    untouched,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_SEED") or np.random.default_rng().integers(2**63))


I16_TYPES = sorted(k_moe.I16_TYPES)


def groups16(q: np.ndarray, s: np.ndarray, qsum: np.ndarray) -> k_moe.Groups16:
    rows, width = q.shape
    meta = np.stack([s.view(np.int32), qsum.astype(np.int32)], axis=-1).reshape(rows, width // 8, 2)
    return k_moe.Groups16(DeviceArray.from_host(np.ascontiguousarray(q)), DeviceArray.from_host(meta))


@pytest.mark.parametrize("shared", [0, 2], ids=["alone", "shared"])
@pytest.mark.parametrize("small", SMALL, ids=lambda s: "n{}_k{}_E{}".format(*s))
@pytest.mark.parametrize("shape", [(256, 256), (512, 96), (2048, 64)], ids=lambda s: "dim{}_F{}".format(*s))
@pytest.mark.parametrize("ggml_type", I16_TYPES, ids=lambda t: t.name)
def test_gate_up16(ggml_type: GGMLType, shape, small, shared: int, seed: int) -> None:
    """moe_gate_up16: the SwiGLU of x rounded to 16 bits, its outputs rounded again into 16-bit groups: each output
    q * s within the float tolerance of the rounded-x reference plus its own rounding (HALF_STEP s), each group's
    step its largest |output| / 32767 and its sum exact; the shared expert's SwiGLU (float) beside it; slack
    poisoned."""
    dim, ff = shape
    n, k, n_experts = small
    needs_blocks(ggml_type, dim)
    rng = np.random.default_rng(seed)
    g, u = Stack(rng, ggml_type, n_experts, ff, dim), Stack(rng, ggml_type, n_experts, ff, dim)
    x, ids = (
        activations(rng, n, dim) * np.exp(rng.normal(size=(n, dim)).astype(np.float32)),
        routed_ids(rng, n, n_experts, k),
    )
    items = n * k
    y = k_moe.Groups16(poisoned((items * ff + 8,), "i2"), poisoned((items * ff // 4 + 2,), "i4"))
    kw = {}
    if shared:
        sg, su = Stack(rng, ggml_type, 1, shared * ff, dim), Stack(rng, ggml_type, 1, shared * ff, dim)
        hs = poisoned((n * shared * ff + 5,))
        kw = {"shared": (sg.dev, su.dev), "hs": hs}
    d_x, d_ids = DeviceArray.from_host(x), DeviceArray.from_host(ids)
    run(k_moe.gate_up(g.dev, u.dev, d_x, d_ids, k, items, y, **kw))
    context = f"{ggml_type.name} dim={dim} F={ff} n={n} k={k} E={n_experts} shared={shared} seed={seed}"
    xr = rounded(x)
    e = ids.reshape(-1)
    ref, tol = swiglu_ref(g.dense[e], u.dense[e], np.repeat(xr, k, axis=0))
    q = y.q.to_host()
    meta = y.meta.to_host()
    assert (q[items * ff :].view(np.uint16) == 0xFFFF).all() and untouched(meta[items * ff // 4 :]), context
    q = q[: items * ff].reshape(items, ff // 8, 8).astype(np.int64)
    meta = meta[: items * ff // 4].reshape(items, ff // 8, 2)
    s, qsum = meta[..., 0].view(np.float32).astype(np.float64), meta[..., 1]
    np.testing.assert_array_equal(qsum, q.sum(-1), err_msg=f"{context}: group sums")
    got = (q * s[..., None]).reshape(items, ff)
    err = np.abs(got - ref)
    bound = tol + np.repeat(s, 8, axis=-1) * HALF_STEP + 1e-30
    assert (err <= bound).all(), f"{context}: worst {(err / bound).max():.3g} of the bound"
    peak, slack = (a.reshape(items, ff // 8, 8).max(-1) for a in (np.abs(ref), tol))
    assert (np.abs(s * 32767 - peak) <= slack + 1e-4 * peak + 1e-30).all(), f"{context}: group steps"
    if shared:
        want, t = swiglu_ref(np.repeat(sg.dense, n, 0), np.repeat(su.dense, n, 0), xr)
        got_hs = hs.to_host()
        assert (np.abs(got_hs[: n * shared * ff].reshape(want.shape) - want) <= t + 1e-30).all(), context
        assert untouched(got_hs[n * shared * ff :]), context


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "plain"])
@pytest.mark.parametrize("shared", ["none", "gated"])
@pytest.mark.parametrize("small", SMALL, ids=lambda s: "n{}_k{}_E{}".format(*s))
@pytest.mark.parametrize("shape", [(256, 256), (96, 768), (61, 768), (64, 1408)], ids=lambda s: "dim{}_F{}".format(*s))
@pytest.mark.parametrize("ggml_type", I16_TYPES, ids=lambda t: t.name)
def test_down16(ggml_type: GGMLType, shape, small, shared: str, staged: bool, seed: int, monkeypatch) -> None:
    """moe_down16 and moe_down16s (rows staged, where they fit) on 16-bit groups made here: the weighted sum of the
    rows dotted with q * s exactly, the float tolerance of moe_down, plus the shared expert; nothing past the outputs
    written (61 rows: the last staged block's rows past R)."""
    monkeypatch.setenv("REFLEX_STAGED_DOWN", "1" if staged else "0")
    dim, ff = shape
    n, k, n_experts = small
    needs_blocks(ggml_type, ff)
    rng = np.random.default_rng(seed)
    d = Stack(rng, ggml_type, n_experts, dim, ff)
    h, ids = (
        activations(rng, n * k, ff) * np.exp(rng.normal(size=(n * k, ff)).astype(np.float32)),
        routed_ids(rng, n, n_experts, k),
    )
    h[0, 8:16] = 0.0  # an all-zero group
    wts = rng.random((n, k)).astype(np.float32)
    x0, ys, sg = activations(rng, n, dim), activations(rng, n, dim), rng.random(n).astype(np.float32)
    x = DeviceArray.from_host(np.concatenate([x0.reshape(-1), np.full(5, np.nan, np.float32)]))
    d_ids, d_w, d_ys, d_sg = (DeviceArray.from_host(a) for a in (ids, wts, ys, sg))
    hq = groups16(*round16(h))
    gated = shared == "gated"
    launch = k_moe.down(d.dev, hq, d_ids, d_w, k, n, x, shared=d_ys if gated else None, sgate=d_sg if gated else None)
    assert launch.name.endswith(f"moe_down16{'s' if staged and k_moe.staged_down(d.dev, k) else ''}_{d.dev.tag}")
    run(launch)
    hr = rounded(h)
    e = ids.reshape(-1)
    per = np.einsum("prc,pc->pr", d.dense[e], hr).reshape(n, k, dim)
    per_abs = RTOL * np.einsum("prc,pc->pr", np.abs(d.dense[e]), np.abs(hr)).reshape(n, k, dim)
    ref = x0 + np.einsum("tk,tkr->tr", wts, per) + (sg[:, None] * ys if gated else 0.0)
    tol = np.einsum("tk,tkr->tr", wts, per_abs) + 1e-6 * np.abs(ref) + (1e-6 * np.abs(ys) if gated else 0.0)
    got = x.to_host()
    context = f"{ggml_type.name} dim={dim} F={ff} n={n} k={k} E={n_experts} shared={shared} seed={seed}"
    err = np.abs(got[: n * dim].reshape(n, dim) - ref)
    assert (err <= tol).all(), f"{context}: worst {np.nanmax(err / tol):.3g} of the bound, NaN: {np.isnan(err).sum()}"
    assert np.isnan(got[n * dim :]).all(), f"{context}: written past the outputs"


def test_i16_forms_keep_nan_and_refuse_what_they_cannot_take(seed: int) -> None:
    """A NaN activation gives NaN outputs (not a finite guess); the wrappers refuse unfused pairs, other types and
    widths that are not whole groups."""
    rng = np.random.default_rng(seed)
    g, u = Stack(rng, GGMLType.Q4_K, 2, 64, 256), Stack(rng, GGMLType.Q4_K, 2, 64, 256)
    x = activations(rng, 1, 256)
    x[0, 17] = np.nan
    y = k_moe.Groups16.empty(2, 64)
    run(k_moe.gate_up(g.dev, u.dev, DeviceArray.from_host(x), DeviceArray.from_host(np.array([[0, 1]], np.int32)),
                      2, 2, y))  # fmt: skip
    assert np.isnan(y.meta.to_host()[..., 0].view(np.float32)).all()
    d_ids = DeviceArray.from_host(np.array([[0, 1]], np.int32))
    with pytest.raises(CudaError, match="16-bit"):
        k_moe.gate_up(g.dev, None, DeviceArray.from_host(x), d_ids, 2, 2, y)
    f = Stack(rng, GGMLType.Q5_K, 2, 64, 256)
    with pytest.raises(CudaError, match="16-bit"):
        k_moe.gate_up(f.dev, f.dev, DeviceArray.from_host(x), d_ids, 2, 2, y)
    with pytest.raises(CudaError, match="multiple of 8"):
        k_moe.Groups16.empty(2, 60)

    def stack(t: GGMLType, rows: int, cols: int) -> DeviceWeight:
        return DeviceWeight(0x1000, t, rows, cols, row_bytes(t, cols), t.name)

    down, gate = stack(GGMLType.Q5_0, 256, 64), stack(GGMLType.Q4_K, 64, 256)
    assert k_moe.takes_i16(gate, gate, down) and not k_moe.takes_i16(gate, None, down)
    assert not k_moe.takes_i16(gate, gate, stack(GGMLType.Q5_1, 256, 64))
    narrow = stack(GGMLType.Q4_K, 36, 256)  # 36 rows: the last gate_up block would hold half a group
    assert not k_moe.takes_i16(narrow, narrow, stack(GGMLType.Q8_0, 256, 64))
