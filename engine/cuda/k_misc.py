"""Launch wrappers for kernels/elementwise.cu and kernels/smoke.cu (contract: kernels/README.md)."""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import DeviceArray, Launch


def swiglu(g: DeviceArray, u: DeviceArray, y: DeviceArray, n: int) -> Launch:
    """y[:n] = silu(g[:n]) * u[:n]; g, u, y f32 (y may alias g)."""
    for a, what in ((g, "g"), (u, "u"), (y, "y")):
        driver.need(a, what, "f4", n)
    fn = driver.module("elementwise").fn("swiglu_f32")
    return Launch(fn, ((n + 255) // 256,), (256,), [driver.ptr(g), driver.ptr(u), driver.ptr(y), driver.i64(n)])


def axpy(a: float, x: DeviceArray, y: DeviceArray, n: int) -> Launch:
    """y[:n] = a * x[:n] + y[:n]; x, y f32."""
    driver.need(x, "x", "f4", n)
    driver.need(y, "y", "f4", n)
    fn = driver.module("smoke").fn("axpy_f32")
    return Launch(fn, ((n + 255) // 256,), (256,), [driver.f32(a), driver.ptr(x), driver.ptr(y), driver.i32(n)])
