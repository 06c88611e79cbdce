"""CUDA through libcuda (ctypes), without NVRTC and without `import cupy`: the primary context (created on a thread
when the caller wants it overlapped with other start-up work: engine/cuda/context.py), prebuilt kernel modules
(cuModuleLoad of kernels/build/*.fatbin) and launches (cuLaunchKernel, or cuLaunchKernelEx with programmatic
dependent launch on sm_90+, with typed scalar arguments packed once). Memory, copies and graphs are
engine/cuda/memory.py's. Every failure becomes a `CudaError` (or `OutOfMemory`) naming the call.
"""

from __future__ import annotations

import ctypes
import os
import threading

from engine.cuda import memory
from engine.errors import CudaError, OutOfMemory

KERNEL_DIR = os.environ.get(
    "REFLEX_KERNEL_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "kernels", "build")
)

_lib: ctypes.CDLL | None = None


def libcuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from e
    return _lib


def check(result: int, what: str) -> None:
    """Raise for a non-zero CUresult."""
    if result == 0:
        return
    name = ctypes.c_char_p()
    libcuda().cuGetErrorName(result, ctypes.byref(name))
    text = (name.value or b"?").decode()
    cls = OutOfMemory if result == memory.OUT_OF_MEMORY else CudaError
    raise cls(f"{what} failed: {text} ({result})")


# -- context (created on its own thread by engine/cuda/context.py) ----------------------------------------------

_ctx_lock = threading.Lock()
_primary: dict[int, ctypes.c_void_p] = {}


def start_context(device: int = 0) -> None:
    """Retain the primary context of `device` and make it current on the calling thread."""
    lib = libcuda()
    with _ctx_lock:
        ctx = _primary.get(device)
        if ctx is None:
            check(lib.cuInit(0), "cuInit")
            dev = ctypes.c_int()
            check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            ctx = ctypes.c_void_p()
            check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _primary[device] = ctx
            _use_pdl(lib, device)
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


# -- programmatic dependent launch ---------------------------------------------------------------------------------
# On sm_90+ the launches of a decode step carry CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# (kernels/pdl.cuh): a kernel's launch overlaps the run of the one before, and its blocks wait on the device until
# that one is done. Every kernel of kernels/ starts with pdl::begin() (or prefetches weights, then waits), so none
# touches memory before its predecessor has finished. Measured on one H200 (2026-12-01, `engine bench` / `engine
# profile`, PDL on vs REFLEX_PDL=0): decode steps 2-6 % shorter (DeepSeek-V2-Lite shaped 359.6 -> 381.1 tok/s), but
# pp512 of the 0.6B shape 40.2k -> 27.7k tok/s with every launch programmatic, so prefill and system1 launch
# plainly. REFLEX_PDL=0 turns it off.
_PDL_ATTRIBUTE = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_pdl = False


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("n_attrs", ctypes.c_uint)]  # fmt: skip


_PDL_ATTRS = (_LaunchAttribute * 1)(_LaunchAttribute(id=_PDL_ATTRIBUTE, value=1))


def _use_pdl(lib: ctypes.CDLL, device: int) -> None:
    """Set once, when the device's primary context is created."""
    global _pdl
    major = _attribute(lib, _CC_MAJOR, device)
    _pdl = major >= 9 and os.environ.get("REFLEX_PDL", "1") != "0" and hasattr(lib, "cuLaunchKernelEx")


def programmatic(launches: list[Launch]) -> list[Launch]:
    """Mark launches (one decode step's) to go out as programmatic dependent launches where the GPU has them: each
    gets its CUlaunchConfig, packed once like its arguments."""
    for launch in launches:
        g, b = launch.grid, launch.block
        launch._config = _LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), launch.smem, None,
                                       _PDL_ATTRS, 1)  # fmt: skip
    return launches


def pdl_enabled() -> bool:
    """Whether launches carry the programmatic-dependent-launch attribute (set when a context starts)."""
    return _pdl


_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR


def _attribute(lib: ctypes.CDLL, attribute: int, device: int) -> int:
    value = ctypes.c_int()
    check(lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device), "cuDeviceGetAttribute")
    return value.value


def attribute(attribute: int, device: int = 0) -> int:
    """cuDeviceGetAttribute(attribute) of `device`."""
    return _attribute(libcuda(), attribute, device)


_majors: dict[int, int] = {}


def compute_major(device: int = 0) -> int:
    """The device's compute capability major (8: sm_80 and sm_86/89, 9: sm_90), read once."""
    if device not in _majors:
        _majors[device] = attribute(_CC_MAJOR, device)
    return _majors[device]


def device_info(device: int = 0) -> dict:
    lib = libcuda()
    name = ctypes.create_string_buffer(256)
    check(lib.cuDeviceGetName(name, 256, device), "cuDeviceGetName")
    major, minor = _attribute(lib, _CC_MAJOR, device), _attribute(lib, _CC_MINOR, device)
    free, total = memory.rt_call("cudaMemGetInfo", memory.runtime().memGetInfo)
    return {"name": name.value.decode(), "arch": f"sm_{major}{minor}", "free_mib": free >> 20,
            "total_mib": total >> 20}  # fmt: skip


# -- modules and launches ----------------------------------------------------------------------------------


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(int(v))


def u64(v: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(v))


def f32(v: float) -> ctypes.c_float:
    return ctypes.c_float(float(v))


class _DevicePtr(ctypes.c_void_p):
    """A pointer argument that keeps its DeviceArray alive as long as the Launch holding it."""


def ptr(p: int | memory.DeviceArray | memory.DeviceWeight | None) -> ctypes.c_void_p:
    """A device pointer argument; None is the null pointer (an absent optional input)."""
    if p is None:
        return ctypes.c_void_p(0)
    if isinstance(p, int):
        return ctypes.c_void_p(p)
    arg = _DevicePtr(p.ptr)
    arg.owner = p
    return arg


class Launch:
    """One kernel launch with its arguments packed once, so it can be issued (or captured) cheaply and often."""

    def __init__(self, fn: ctypes.c_void_p, grid: tuple[int, ...], block: tuple[int, ...], args: list, smem: int = 0):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        if min(self.grid) < 1 or min(self.block) < 1:
            raise CudaError(f"empty launch grid {self.grid} / block {self.block}")
        self.smem = smem
        self.name = _kernel_names.get(fn.value, "?")  # "module.kernel", for profiles and error messages
        self._args = args  # the ctypes values the parameter array points into: kept alive with it
        self._params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self._config: _LaunchConfig | None = None  # set by programmatic(): a programmatic dependent launch

    def __call__(self, stream: int = 0) -> None:
        if _pdl and self._config is not None:
            self._config.stream = stream
            config = ctypes.byref(self._config)
            check(libcuda().cuLaunchKernelEx(config, self.fn, self._params, None), "cuLaunchKernelEx")
            return
        g, b = self.grid, self.block
        check(libcuda().cuLaunchKernel(self.fn, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, ctypes.c_void_p(stream),
                                       self._params, None), "cuLaunchKernel")  # fmt: skip


_SMEM_OPTIN = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_SMEM_CARVEOUT, _CARVEOUT_MAX_SHARED = 9, 100  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, its maximum
SMEM_OPTIN_LIMIT = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
_smem_allowed: dict[int, int] = {}  # function -> the dynamic shared memory it was allowed


def allow_smem(fn: ctypes.c_void_p, smem: int, most_shared: bool = False) -> None:
    """Let kernel `fn` take `smem` bytes of dynamic shared memory: above 48 KiB a kernel must opt in (once).
    most_shared: also ask for the largest shared-memory share of the SM's L1 (a hint), for a kernel that needs it to
    keep more than one block an SM."""
    if smem > 48 * 1024 and _smem_allowed.get(fn.value, 0) < smem:
        name = _kernel_names.get(fn.value, "?")
        check(libcuda().cuFuncSetAttribute(fn, _SMEM_OPTIN, smem), f"cuFuncSetAttribute({name}, {smem} bytes)")
        if most_shared:
            check(libcuda().cuFuncSetAttribute(fn, _SMEM_CARVEOUT, _CARVEOUT_MAX_SHARED), f"carveout of {name}")
        _smem_allowed[fn.value] = smem


_MAX_THREADS = 0  # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
_block_limits: dict[int, int] = {}


def block_limit(fn: ctypes.c_void_p) -> int:
    """The most threads a block of kernel `fn` may have: its __launch_bounds__, so a launch can take the block a
    kernel was built for (kernels/gemm_tc.cu's PIPE_WARPS). Read once a kernel."""
    if fn.value not in _block_limits:
        v = ctypes.c_int()
        name = _kernel_names.get(fn.value, "?")
        check(libcuda().cuFuncGetAttribute(ctypes.byref(v), _MAX_THREADS, fn), f"cuFuncGetAttribute({name})")
        _block_limits[fn.value] = v.value
    return _block_limits[fn.value]


class Module:
    """A prebuilt kernel module kernels/build/<name>.fatbin (never compiled at run time)."""

    def __init__(self, name: str, directory: str | None = None):
        path = os.path.join(directory or KERNEL_DIR, name + ".fatbin")
        if not os.path.exists(path):
            raise CudaError(
                f"kernel module {path} is missing: run ./build_kernels.sh (needs nvcc) to build the kernels"
            )
        self.name = name
        self.handle = ctypes.c_void_p()
        check(libcuda().cuModuleLoad(ctypes.byref(self.handle), path.encode()), f"cuModuleLoad({path})")
        self._functions: dict[str, ctypes.c_void_p] = {}

    def fn(self, name: str) -> ctypes.c_void_p:
        f = self._functions.get(name)
        if f is None:
            f = ctypes.c_void_p()
            check(libcuda().cuModuleGetFunction(ctypes.byref(f), self.handle, name.encode()),
                  f"cuModuleGetFunction({self.name}.{name})")  # fmt: skip
            self._functions[name] = f
            _kernel_names[f.value] = f"{self.name}.{name}"
        return f


_modules: dict[str, Module] = {}
_module_lock = threading.Lock()
_kernel_names: dict[int, str] = {}  # function handle -> "module.kernel"


def module(name: str) -> Module:
    """The loaded module `name` (loaded on first use; ContextStarter.preload may load it on another thread)."""
    m = _modules.get(name)
    if m is None:
        with _module_lock:
            m = _modules.get(name)
            if m is None:
                m = _modules[name] = Module(name)
    return m


def probe() -> tuple[bool, str]:
    """Whether the CUDA backend can run here: a driver, a device, CuPy's bindings and the built kernels."""
    try:
        lib = libcuda()
        if lib.cuInit(0) != 0:
            return False, "cuInit failed (no usable GPU)"
        count = ctypes.c_int()
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
            return False, "no CUDA device"
        memory.runtime()
    except CudaError as e:
        return False, str(e)
    if not kernels_built():
        return False, f"no built kernels in {KERNEL_DIR} (run ./build_kernels.sh)"
    return True, "ok"


def kernels_built() -> bool:
    """Whether ./build_kernels.sh has run: the one check every caller uses."""
    return os.path.exists(os.path.join(KERNEL_DIR, "manifest.json"))
