"""Launch wrapper for kernels/lora.cu, the LoRA glue the existing kernels do not cover (contract: kernels/README.md,
"lora.cu")."""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import Launch
from engine.cuda.memory import DeviceArray, need
from engine.errors import CudaError

THREADS = 256


def add(y: DeviceArray, d: DeviceArray, n: int) -> Launch:
    """y[:n] += d[:n]; y, d f32, apart."""
    need(y, "y", "f4", n)
    need(d, "d", "f4", n)
    if y.ptr < d.ptr + 4 * n and d.ptr < y.ptr + 4 * n:
        raise CudaError("lora add: y overlaps d")
    fn = driver.module("lora").fn("lora_add_f32")
    return Launch(fn, ((n + THREADS - 1) // THREADS,), (THREADS,), [driver.ptr(y), driver.ptr(d), driver.i64(n)])
