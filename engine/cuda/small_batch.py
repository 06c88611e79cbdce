"""Matmuls of small batches (n <= dispatch.MATVEC_MAX tokens) with the RMSNorm fused: one tensor-core launch
(k_tc_matvec) where the weight type has one and dispatch.use_tc picks it, else matvec passes of <= 8 tokens. Both
compute float32-exact sums in effect, so the models need not know which ran. Up to three matrices that read the same
x (q/k/v) share one launch where fuses3 allows: matvec3 for one token, tcmv3 for a tensor-core batch.
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


def fuses3(n: int, ggml_type: int) -> bool:
    """Whether n tokens through a matrix of this type may go through matmul3 with others of its width (the types
    that may share one launch: k_matvec.matvec3_order)."""
    if n == 1:
        return km.has_matvec3(ggml_type)
    return ktc.has(ggml_type) and dispatch.use_tc(n) and dispatch.tc3()


def matmul3(
    ws: list[DeviceWeight],  # 1 to 3 matrices (R_m, K) of one width, in an order k_matvec.matvec3_order keeps
    x: DeviceArray,  # (n, K) f4
    n: int,  # tokens: 1, or a batch fuses3 takes
    ys: list[DeviceArray],  # (n, R_m) f4 each; ys[m] = ws[m] . rmsnorm(x)
    *,
    norm_w: DeviceArray | None = None,  # (K,) f4
    eps: float = 0.0,
) -> Launch:
    if n == 1:
        return km.matvec3(ws, x, ys, norm_w=norm_w, eps=eps)
    return ktc.tcmv3(ws, x, n, ys, norm_w=norm_w, eps=eps)


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
