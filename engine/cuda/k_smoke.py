"""Launch wrapper for kernels/smoke.cu, the AOT pipeline check (contract: kernels/README.md)."""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import Launch
from engine.cuda.memory import DeviceArray, need


def axpy(a: float, x: DeviceArray, y: DeviceArray, n: int) -> Launch:
    """y[:n] = a * x[:n] + y[:n]; x, y f32."""
    need(x, "x", "f4", n)
    need(y, "y", "f4", n)
    fn = driver.module("smoke").fn("axpy_f32")
    return Launch(fn, ((n + 255) // 256,), (256,), [driver.f32(a), driver.ptr(x), driver.ptr(y), driver.i32(n)])
