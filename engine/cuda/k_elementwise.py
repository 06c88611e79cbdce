"""Launch wrapper for kernels/elementwise.cu (contract: kernels/README.md)."""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import Launch
from engine.cuda.memory import DeviceArray, need


def swiglu(g: DeviceArray, u: DeviceArray, y: DeviceArray, n: int) -> Launch:
    """y[:n] = silu(g[:n]) * u[:n]; g, u, y f32 (y may alias g)."""
    for a, what in ((g, "g"), (u, "u"), (y, "y")):
        need(a, what, "f4", n)
    fn = driver.module("elementwise").fn("swiglu_f32")
    return Launch(fn, ((n + 255) // 256,), (256,), [driver.ptr(g), driver.ptr(u), driver.ptr(y), driver.i64(n)])
