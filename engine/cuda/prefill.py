"""The matmuls of a prefill batch past dispatch.MATVEC_MAX tokens: gemm.cu's tile (engine/cuda/k_gemm.py), or one of
gemm_tc.cu's (engine/cuda/k_gemm_tc.py), the two-pass dense GEMM (where k_gemm.reserve set its slab aside) or the
pipelined one, as dispatch.prefill_gemm picks for a quantized weight."""

from __future__ import annotations

from engine.cuda import dispatch, driver, k_gemm, k_gemm_tc
from engine.cuda.driver import Launch
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.quants import FLOAT_TYPES


def matmul(w: DeviceWeight, a: DeviceArray, n: int, c: DeviceArray, *,
           resid: DeviceArray | None = None) -> list[Launch]:  # fmt: skip
    """c[:n] = a[:n] . w^T (+ resid)."""
    kind = _kind(w, n)
    if kind == "dense":
        return k_gemm_tc.gemm_dense(w, a, n, c, resid=resid)
    if kind == "pipe":
        return [k_gemm_tc.gemm_pipe(w, a, n, c, resid=resid)]
    return [k_gemm.gemm(w, a, n, c, resid=resid)]


def swiglu(wg: DeviceWeight, wu: DeviceWeight, a: DeviceArray, n: int, c: DeviceArray) -> list[Launch]:
    """c[:n] = silu(a . wg^T) * (a . wu^T)."""
    kind = _kind(wg, n)
    if kind == "dense":
        return k_gemm_tc.gemm_dense(wg, a, n, c, up=wu)
    if kind == "pipe":
        return [k_gemm_tc.gemm_pipe(wg, a, n, c, up=wu)]
    return [k_gemm.gemm_swiglu(wg, wu, a, n, c)]


def matmuls(ws: list[DeviceWeight], a: DeviceArray, n: int, cs: list[DeviceArray]) -> list[Launch]:
    """cs[m][:n] = a[:n] . ws[m]^T for matrices of one input (q/k/v): those that take the dense GEMM three at a time
    through one slab and one gemm_dense launch (k_gemm_tc.gemm_dense3), the others a launch each."""
    dense: list[tuple[DeviceWeight, DeviceArray]] = []
    out: list[Launch] = []
    for w, c in zip(ws, cs, strict=True):
        if _kind(w, n) == "dense":
            dense.append((w, c))
        else:
            out += matmul(w, a, n, c)
    for at in range(0, len(dense), 3):
        group = dense[at : at + 3]
        out += k_gemm_tc.gemm_dense3([w for w, _ in group], a, n, [c for _, c in group])
    return out


def _kind(w: DeviceWeight, n: int) -> str:
    """ "tile", "dense" or "pipe" for w at n tokens: dispatch.prefill_gemm's choice where the GPU and the weight allow
    it (a quantized type; the dense GEMM's slab reserved)."""
    if w.ggml_type in FLOAT_TYPES:
        return "tile"
    kind = dispatch.prefill_gemm(n, driver.compute_major())
    if kind == "tile" or not k_gemm_tc.fits():
        return "tile"
    work = k_gemm.workspace()
    return "tile" if kind == "dense" and (work is None or work.slab is None) else kind
