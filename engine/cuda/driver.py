"""CUDA access without NVRTC and without `import cupy`.

- The primary context is created through libcuda (ctypes: cuInit, cuDevicePrimaryCtxRetain), from a thread if the
  caller wants it overlapped with other start-up work; CuPy's runtime then uses that same primary context.
- Memory, copies, streams, events and graphs go through CuPy's low-level runtime bindings
  (`cupy_backends.cuda.api.runtime`, a few milliseconds to import, no NumPy, no CuPy array layer).
- Kernels come only from prebuilt files in kernels/build/ (cuModuleLoad) and are launched with cuLaunchKernel.
Every failure becomes a `CudaError` (or `OutOfMemory`) naming the call.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

from engine.errors import CudaError, OutOfMemory

KERNEL_DIR = os.environ.get(
    "REFLEX_KERNEL_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "kernels", "build")
)
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY; cudaErrorMemoryAllocation is also 2
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind

_lib: ctypes.CDLL | None = None
_rt = None  # cupy_backends.cuda.api.runtime, imported on first use


def libcuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from e
    return _lib


def runtime():
    global _rt
    if _rt is None:
        try:
            from cupy_backends.cuda.api import runtime as rt
        except ImportError as e:
            raise CudaError(f"CuPy's CUDA bindings are missing (pip install 'reflex-worker[cuda]'): {e}") from e
        _rt = rt
    return _rt


def check(result: int, what: str) -> None:
    """Raise for a non-zero CUresult."""
    if result == 0:
        return
    name = ctypes.c_char_p()
    libcuda().cuGetErrorName(result, ctypes.byref(name))
    text = (name.value or b"?").decode()
    cls = OutOfMemory if result == _OUT_OF_MEMORY else CudaError
    raise cls(f"{what} failed: {text} ({result})")


def rt_call(what: str, fn, *args):
    """Call a CuPy runtime binding, turning its exception into a typed engine error."""
    try:
        return fn(*args)
    except Exception as e:  # CUDARuntimeError and friends
        status = getattr(e, "status", None)
        cls = OutOfMemory if status == _OUT_OF_MEMORY else CudaError
        raise cls(f"{what} failed: {e}") from e


# -- context ------------------------------------------------------------------------------------------------


class ContextStarter:
    """Creates the primary context of `device` on a background thread; `wait()` returns its start-up time."""

    def __init__(self, device: int = 0):
        self.device = device
        self.error: BaseException | None = None
        self.ms = 0.0
        self._thread = threading.Thread(target=self._run, name="cuda-context", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from engine.timing import Stopwatch

        try:
            with Stopwatch() as sw:
                start_context(self.device)
            self.ms = sw.ms
        except BaseException as e:  # handed to the waiting thread
            self.error = e

    def wait(self) -> float:
        self._thread.join()
        if self.error is not None:
            raise self.error
        # The runtime binds to the primary context the thread created; this thread must make it current too.
        start_context(self.device)
        return self.ms


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
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def device_info(device: int = 0) -> dict:
    lib = libcuda()
    name = ctypes.create_string_buffer(256)
    check(lib.cuDeviceGetName(name, 256, device), "cuDeviceGetName")
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(lib.cuDeviceGetAttribute(ctypes.byref(major), 75, device), "cuDeviceGetAttribute")  # CC major
    check(lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, device), "cuDeviceGetAttribute")  # CC minor
    free, total = rt_call("cudaMemGetInfo", runtime().memGetInfo)
    return {"name": name.value.decode(), "arch": f"sm_{major.value}{minor.value}", "free_mib": free >> 20,
            "total_mib": total >> 20}  # fmt: skip


# -- memory, streams ---------------------------------------------------------------------------------------


def malloc(n_bytes: int) -> int:
    return rt_call(f"cudaMalloc({n_bytes} bytes)", runtime().malloc, max(1, n_bytes))


def free(ptr: int) -> None:
    rt_call("cudaFree", runtime().free, ptr)


def memcpy(dst: int, src: int, n_bytes: int, kind: int) -> None:
    rt_call("cudaMemcpy", runtime().memcpy, dst, src, n_bytes, kind)


def memcpy_async(dst: int, src: int, n_bytes: int, kind: int, stream: int) -> None:
    rt_call("cudaMemcpyAsync", runtime().memcpyAsync, dst, src, n_bytes, kind, stream)


def memset_async(ptr: int, value: int, n_bytes: int, stream: int) -> None:
    rt_call("cudaMemsetAsync", runtime().memsetAsync, ptr, value, n_bytes, stream)


def host_register(ptr: int, n_bytes: int, read_only: bool = True) -> None:
    # cudaHostRegisterReadOnly (8): the mmap'd file is read-only; pinning it lets one copy run at full PCIe speed.
    rt_call("cudaHostRegister", runtime().hostRegister, ptr, n_bytes, 8 if read_only else 0)


def host_alloc(n_bytes: int) -> int:
    """Page-locked host memory (for small staging buffers; freed with host_free)."""
    return rt_call(f"cudaHostAlloc({n_bytes} bytes)", runtime().hostAlloc, max(1, n_bytes), 0)


def host_free(ptr: int) -> None:
    rt_call("cudaFreeHost", runtime().freeHost, ptr)


def host_unregister(ptr: int) -> None:
    rt_call("cudaHostUnregister", runtime().hostUnregister, ptr)


def stream_create() -> int:
    return rt_call("cudaStreamCreateWithFlags", runtime().streamCreateWithFlags, 1)  # non-blocking


def synchronize(stream: int) -> None:
    rt_call("cudaStreamSynchronize", runtime().streamSynchronize, stream)


class Graph:
    """A captured sequence of launches on `stream`, replayed with one call."""

    def __init__(self, stream: int):
        self.stream = stream
        self.exec = 0

    def __enter__(self) -> Graph:
        rt_call("cudaStreamBeginCapture", runtime().streamBeginCapture, self.stream)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        graph = rt_call("cudaStreamEndCapture", runtime().streamEndCapture, self.stream)
        try:
            if exc_type is None:
                self.exec = rt_call("cudaGraphInstantiate", runtime().graphInstantiate, graph)
        finally:
            rt_call("cudaGraphDestroy", runtime().graphDestroy, graph)

    def launch(self) -> None:
        rt_call("cudaGraphLaunch", runtime().graphLaunch, self.exec, self.stream)

    def destroy(self) -> None:
        if self.exec:
            rt_call("cudaGraphExecDestroy", runtime().graphExecDestroy, self.exec)
            self.exec = 0


class Timer:
    """Device-side elapsed time between `start()` and `stop()` on a stream (ms)."""

    def __init__(self, stream: int):
        self.stream = stream
        self.a = rt_call("cudaEventCreate", runtime().eventCreate)
        self.b = rt_call("cudaEventCreate", runtime().eventCreate)

    def start(self) -> None:
        rt_call("cudaEventRecord", runtime().eventRecord, self.a, self.stream)

    def stop(self) -> float:
        rt = runtime()
        rt_call("cudaEventRecord", rt.eventRecord, self.b, self.stream)
        rt_call("cudaEventSynchronize", rt.eventSynchronize, self.b)
        return rt_call("cudaEventElapsedTime", rt.eventElapsedTime, self.a, self.b)


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


def ptr(p: int | DeviceArray | DeviceWeight | None) -> ctypes.c_void_p:
    """A device pointer argument; None is the null pointer (an absent optional input)."""
    if p is None:
        return ctypes.c_void_p(0)
    if isinstance(p, int):
        return ctypes.c_void_p(p)
    arg = _DevicePtr(p.ptr)
    arg.owner = p
    return arg


def need(a: DeviceArray | None, name: str, dtype: str, n: int, aligned: bool = False) -> None:
    """A launch wrapper's input check: `a` exists, has dtype and at least n elements, 16-byte aligned if asked."""
    if a is None:
        raise CudaError(f"{name}: missing")
    if a.dtype != dtype or a.size < n:
        raise CudaError(f"{name}: needs {n} elements of {dtype}, got {a.size} of {a.dtype}")
    if aligned and a.ptr % 16:
        raise CudaError(f"{name}: address {a.ptr:#x} is not 16-byte aligned")


def need_aligned_weight(w: DeviceWeight) -> None:
    if w.ptr % 16:
        raise CudaError(f"weight {w.name}: address {w.ptr:#x} is not 16-byte aligned")


class Launch:
    """One kernel launch with its arguments packed once, so it can be issued (or captured) cheaply and often."""

    def __init__(self, fn: ctypes.c_void_p, grid: tuple[int, ...], block: tuple[int, ...], args: list, smem: int = 0):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        if min(self.grid) < 1 or min(self.block) < 1:
            raise CudaError(f"empty launch grid {self.grid} / block {self.block}")
        self.smem = smem
        self._args = args  # the ctypes values the parameter array points into: kept alive with it
        self._params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])

    def __call__(self, stream: int = 0) -> None:
        g, b = self.grid, self.block
        check(libcuda().cuLaunchKernel(self.fn, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, ctypes.c_void_p(stream),
                                       self._params, None), "cuLaunchKernel")  # fmt: skip


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
        return f


_modules: dict[str, Module] = {}


def module(name: str) -> Module:
    m = _modules.get(name)
    if m is None:
        m = _modules[name] = Module(name)
    return m


# -- device arrays -----------------------------------------------------------------------------------------

_ITEMSIZE = {"f4": 4, "f2": 2, "i4": 4, "i8": 8, "u1": 1, "u4": 4, "u8": 8}


class DeviceArray:
    """A device allocation with a shape and a dtype code ("f4", "i4", "u1", ...). Owns its memory unless a view."""

    def __init__(self, ptr_: int, shape: tuple[int, ...], dtype: str, owner: bool):
        self.ptr = ptr_
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.owner = owner

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.size * _ITEMSIZE[self.dtype]

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: str = "f4") -> DeviceArray:
        a = cls(0, shape, dtype, owner=True)
        a.ptr = malloc(a.nbytes)
        return a

    @classmethod
    def from_host(cls, array) -> DeviceArray:
        """Copy a NumPy array (made C-contiguous) to a new device array."""
        import numpy as np

        array = np.ascontiguousarray(array)
        a = cls.empty(array.shape, array.dtype.str[1:])
        memcpy(a.ptr, array.ctypes.data, a.nbytes, H2D)
        return a

    def to_host(self):
        import numpy as np

        out = np.empty(self.shape, dtype=np.dtype(self.dtype))
        memcpy(out.ctypes.data, self.ptr, self.nbytes, D2H)
        return out

    def copy_from_host(self, array) -> None:
        import numpy as np

        array = np.ascontiguousarray(array, dtype=np.dtype(self.dtype))
        if array.nbytes != self.nbytes:
            raise CudaError(f"copy of {array.nbytes} bytes into a device array of {self.nbytes}")
        memcpy(self.ptr, array.ctypes.data, self.nbytes, H2D)

    def fill_byte(self, value: int) -> None:
        """Set every byte (0xFF poisons float32 outputs with NaN, for tests)."""
        rt_call("cudaMemset", runtime().memset, self.ptr, value, self.nbytes)

    def view(self, offset_elems: int, shape: tuple[int, ...]) -> DeviceArray:
        v = DeviceArray(self.ptr + offset_elems * _ITEMSIZE[self.dtype], shape, self.dtype, owner=False)
        if offset_elems < 0 or offset_elems + v.size > self.size:
            raise CudaError(f"view [{offset_elems}, +{v.size}) outside an array of {self.size} elements")
        return v

    def free(self) -> None:
        if self.owner and self.ptr:
            free(self.ptr)
        self.ptr = 0

    def __del__(self) -> None:
        if getattr(self, "owner", False) and self.ptr and _rt is not None:
            with contextlib.suppress(Exception):  # at interpreter exit the context may already be gone
                free(self.ptr)


_TAGS = {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 12: "q4_k",
         13: "q5_k", 14: "q6_k"}  # fmt: skip


class DeviceWeight:
    """A weight matrix on the device in its GGUF block layout: R rows of K values, `row_bytes` apart."""

    def __init__(self, ptr_: int, ggml_type: int, rows: int, cols: int, row_bytes: int, name: str = ""):
        if int(ggml_type) not in _TAGS:
            raise CudaError(f"no CUDA kernels for weight type {ggml_type} ({name})")
        if cols % 32:
            raise CudaError(f"weight {name}: {cols} columns, the kernels need a multiple of 32")
        self.ptr = ptr_
        self.ggml_type = int(ggml_type)
        self.rows = rows
        self.cols = cols
        self.row_bytes = row_bytes
        self.name = name

    @property
    def tag(self) -> str:
        """The kernel-name suffix of this weight type (kernels/README.md)."""
        return _TAGS[self.ggml_type]


def probe() -> tuple[bool, str]:
    """Whether the CUDA backend can run here: a driver, a device, CuPy's bindings and the built kernels."""
    try:
        lib = libcuda()
        if lib.cuInit(0) != 0:
            return False, "cuInit failed (no usable GPU)"
        count = ctypes.c_int()
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
            return False, "no CUDA device"
        runtime()
    except CudaError as e:
        return False, str(e)
    if not os.path.exists(os.path.join(KERNEL_DIR, "manifest.json")):
        return False, f"no built kernels in {KERNEL_DIR} (run ./build_kernels.sh)"
    return True, "ok"
