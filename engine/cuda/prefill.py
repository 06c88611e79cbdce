"""The matmuls of a prefill batch past dispatch.MATVEC_MAX tokens: gemm.cu's one pass (engine/cuda/k_gemm.py), or
gemm_dense.cu's two (engine/cuda/k_gemm_dense.py) where dispatch.dense_gemm picks them for a quantized weight and
k_gemm.reserve has set their slab aside."""

from __future__ import annotations

from engine.cuda import dispatch, driver, k_gemm, k_gemm_dense
from engine.cuda.driver import Launch
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.quants import FLOAT_TYPES


def matmul(w: DeviceWeight, a: DeviceArray, n: int, c: DeviceArray, *,
           resid: DeviceArray | None = None) -> list[Launch]:  # fmt: skip
    """c[:n] = a[:n] . w^T (+ resid)."""
    if _dense(w, n):
        return k_gemm_dense.gemm_dense(w, a, n, c, resid=resid)
    return [k_gemm.gemm(w, a, n, c, resid=resid)]


def swiglu(wg: DeviceWeight, wu: DeviceWeight, a: DeviceArray, n: int, c: DeviceArray) -> list[Launch]:
    """c[:n] = silu(a . wg^T) * (a . wu^T)."""
    if _dense(wg, n):
        return k_gemm_dense.gemm_dense(wg, a, n, c, up=wu)
    return [k_gemm.gemm_swiglu(wg, wu, a, n, c)]


def matmuls(ws: list[DeviceWeight], a: DeviceArray, n: int, cs: list[DeviceArray]) -> list[Launch]:
    """cs[m][:n] = a[:n] . ws[m]^T for matrices of one input (q/k/v): those that take the two passes three at a time
    through one slab and one gemm_dense launch (k_gemm_dense.gemm_dense3), the others a gemm each."""
    dense = [(w, c) for w, c in zip(ws, cs, strict=True) if _dense(w, n)]
    out = [k_gemm.gemm(w, a, n, c) for w, c in zip(ws, cs, strict=True) if not _dense(w, n)]
    for at in range(0, len(dense), 3):
        group = dense[at : at + 3]
        out += k_gemm_dense.gemm_dense3([w for w, _ in group], a, n, [c for _, c in group])
    return out


def _dense(w: DeviceWeight, n: int) -> bool:
    work = k_gemm.workspace()
    return (work is not None and work.slab is not None and w.ggml_type not in FLOAT_TYPES
            and dispatch.dense_gemm(n, driver.compute_major()) and k_gemm_dense.fits())  # fmt: skip
