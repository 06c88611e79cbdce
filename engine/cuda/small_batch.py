"""Matmuls of small batches (n <= dispatch.MATVEC_MAX tokens) with the RMSNorm fused: one tensor-core launch
(k_tc_matvec) where the weight type has one and dispatch.use_tc picks it, else matvec passes of <= 8 tokens. Both
compute float32-exact sums in effect, so the models need not know which ran.
"""

from __future__ import annotations

from engine.cuda import dispatch
from engine.cuda import k_matvec as km
from engine.cuda import k_tc_matvec as ktc
from engine.cuda.driver import Launch
from engine.cuda.memory import DeviceArray, DeviceWeight


def rows(a: DeviceArray, at: int, m: int) -> DeviceArray:
    """Rows at..at+m-1 of a (rows, width) activation buffer."""
    width = a.shape[-1]
    return a.view(at * width, (m, width))


def matmul(
    w: DeviceWeight,  # (R, K) GGUF blocks
    x: DeviceArray,  # (n, K) f4
    n: int,  # tokens, 1..MATVEC_MAX
    y: DeviceArray,  # (n, R) f4; y = resid + w . rmsnorm(x)
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4
    eps: float = 0.0,
    resid: DeviceArray | None = None,  # (n, R) f4, may be y itself
) -> list[Launch]:
    if ktc.has(w.ggml_type) and dispatch.use_tc(n):
        return [ktc.tcmv(w, x, n, y, norm_w=norm_w, eps=eps, resid=resid)]
    return [km.matvec(w, rows(x, at, m), m, rows(y, at, m), norm_w=norm_w, eps=eps,
                      resid=None if resid is None else rows(resid, at, m)) for at, m in dispatch.passes(n)]  # fmt: skip


def swiglu(
    gate: DeviceWeight,  # (R, K) GGUF blocks: ffn_gate
    up: DeviceWeight,  # (R, K) same type and layout: ffn_up
    x: DeviceArray,  # (n, K) f4
    n: int,  # tokens, 1..MATVEC_MAX
    y: DeviceArray,  # (n, R) f4; y = silu(gate . xn) * (up . xn), xn = rmsnorm(x) or x
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4
    eps: float = 0.0,
) -> list[Launch]:
    if ktc.has(gate.ggml_type) and dispatch.use_tc(n):
        return [ktc.tcmv_swiglu(gate, up, x, n, y, norm_w=norm_w, eps=eps)]
    return [km.matvec_swiglu(gate, up, rows(x, at, m), m, rows(y, at, m), norm_w=norm_w, eps=eps)
            for at, m in dispatch.passes(n)]  # fmt: skip
