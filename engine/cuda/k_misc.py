"""Launch wrappers for kernels/elementwise.cu and kernels/smoke.cu (contract: kernels/README.md)."""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import DeviceArray, Launch


def _f32_at_least(a: DeviceArray, n: int, what: str) -> None:
    if a.dtype != "f4" or a.size < n:
        raise driver.CudaError(f"{what}: need a float32 array of >= {n} elements, got {a.dtype}{a.shape}")


def swiglu(g: DeviceArray, u: DeviceArray, y: DeviceArray, n: int) -> Launch:
    """y[:n] = silu(g[:n]) * u[:n]; g, u, y f32 (y may alias g)."""
    for a, what in ((g, "g"), (u, "u"), (y, "y")):
        _f32_at_least(a, n, what)
    fn = driver.module("elementwise").fn("swiglu_f32")
    return Launch(fn, ((n + 255) // 256,), (256,), [driver.ptr(g), driver.ptr(u), driver.ptr(y), driver.i64(n)])


def axpy(a: float, x: DeviceArray, y: DeviceArray, n: int) -> Launch:
    """y[:n] = a * x[:n] + y[:n]; x, y f32."""
    _f32_at_least(x, n, "x")
    _f32_at_least(y, n, "y")
    fn = driver.module("smoke").fn("axpy_f32")
    return Launch(fn, ((n + 255) // 256,), (256,), [driver.f32(a), driver.ptr(x), driver.ptr(y), driver.i32(n)])
