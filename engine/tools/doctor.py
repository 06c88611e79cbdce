"""`smoke` (the AOT pipeline, end to end, timed from process start) and `doctor` (is this machine ready?).

Neither imports NumPy or CuPy proper: host buffers are ctypes arrays, so `smoke` measures the leanest cold path.
"""

from __future__ import annotations

import ctypes
import json
import os

from engine import timing
from engine.errors import EngineError, env_int
from engine.timing import Stopwatch


def smoke() -> dict:
    """y = 3x + y on 1024 floats through the prebuilt `axpy_f32`; every element must come back as 5."""
    from engine.cuda import driver, memory
    from engine.cuda.k_smoke import axpy

    n = 1024
    with Stopwatch() as init_sw:
        driver.start_context(env_int("REFLEX_DEVICE", 0))
    with Stopwatch() as load_sw:
        driver.module("smoke")
    with Stopwatch() as run_sw:
        host_x, host_y = (ctypes.c_float * n)(*([1.0] * n)), (ctypes.c_float * n)(*([2.0] * n))
        x, y = memory.DeviceArray.empty((n,)), memory.DeviceArray.empty((n,))
        memory.memcpy(x.ptr, ctypes.addressof(host_x), 4 * n, memory.H2D)
        memory.memcpy(y.ptr, ctypes.addressof(host_y), 4 * n, memory.H2D)
        axpy(3.0, x, y, n)(0)
        memory.memcpy(ctypes.addressof(host_y), y.ptr, 4 * n, memory.D2H)
    bad = sum(1 for v in host_y if v != 5.0)
    if bad:
        raise EngineError(f"smoke: {bad} of {n} results are wrong")
    return timing.rounded(
        {
            "status": "ok",
            "cuda_init_ms": init_sw.ms,
            "kernel_load_ms": load_sw.ms,
            "kernel_launch_ms": run_sw.ms,
            "process_start_to_first_result_ms": timing.since_process_start_ms(),
        }
    )


def _check(name: str, fn) -> dict:
    try:
        status, detail = fn()
    except Exception as e:  # a failed check is a result, not a crash
        status, detail = "fail", f"{type(e).__name__}: {e}"
    return {"name": name, "status": status, "detail": detail}


def _gpu() -> tuple[str, str]:
    from engine.cuda import driver

    driver.start_context(0)
    info = driver.device_info(0)
    return "pass", f"{info['name']} ({info['arch']}), {info['free_mib']}/{info['total_mib']} MiB free"


def _kernels() -> tuple[str, str]:
    from engine.cuda import driver

    path = os.path.join(driver.KERNEL_DIR, "manifest.json")
    if not os.path.exists(path):
        return "fail", f"no {path}: run ./build_kernels.sh"
    with open(path) as f:
        manifest = json.load(f)
    archs = [f"sm_{a}" for a in manifest["archs"].split(";")]
    arch = driver.device_info(0)["arch"]
    if arch in archs:
        return "pass", f"native code for {arch} in {len(manifest['modules'])} modules ({manifest['nvcc']})"
    ptx = manifest["ptx"]
    if ptx is None:
        return "fail", f"kernels built for {archs} without PTX, which cannot run on {arch}"
    if int(ptx.split("_")[1]) <= int(arch.split("_")[1]):
        return "warn", f"no native code for {arch}: the driver will JIT {ptx} PTX at first load (slow cold start)"
    return "fail", f"kernels built for {archs} + {ptx}, which cannot run on {arch}"


def _smoke() -> tuple[str, str]:
    r = smoke()
    return "pass", f"axpy_f32 correct, first result {r['process_start_to_first_result_ms']} ms after process start"


def _nvml() -> tuple[str, str]:
    try:
        import pynvml
    except ImportError:
        return "warn", "nvidia-ml-py is not installed: no energy figures"
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
        return "pass", f"energy counter readable ({mj} mJ since driver load)"
    except pynvml.NVMLError as e:
        return "warn", f"NVML present but no energy counter: {e}"


def doctor() -> tuple[dict, int]:
    """Checks and an exit code: 0 all pass, 1 a check failed."""
    checks = [_check("gpu_probe", _gpu), _check("aot_kernels", _kernels), _check("aot_kernel_launch", _smoke),
              _check("nvml_energy", _nvml)]  # fmt: skip
    failed = sum(c["status"] == "fail" for c in checks)
    warned = sum(c["status"] == "warn" for c in checks)
    summary = {"status": "fail" if failed else "ok", "checks": checks, "passed": len(checks) - failed - warned,
               "warned": warned, "failed": failed}  # fmt: skip
    return summary, 1 if failed else 0
