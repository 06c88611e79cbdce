"""Device memory through CuPy's low-level runtime bindings (`cupy_backends.cuda.api.runtime`: a few milliseconds to
import, no NumPy, no CuPy array layer): allocations, copies, streams, events, graphs, and the typed views the launch
wrappers check — `DeviceArray` (activations, caches) and `DeviceWeight` (a matrix in its GGUF block layout).
The runtime binds to the primary context that engine/cuda/driver.py creates. Every failure becomes a `CudaError`
(or `OutOfMemory`) naming the call.
"""

from __future__ import annotations

import contextlib

from engine.errors import CudaError, OutOfMemory
from engine.quants import KERNEL_TAGS

OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation (CUDA_ERROR_OUT_OF_MEMORY is 2 too)
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind

_rt = None  # cupy_backends.cuda.api.runtime, imported on first use


def runtime():
    global _rt
    if _rt is None:
        try:
            from cupy_backends.cuda.api import runtime as rt
        except ImportError as e:
            raise CudaError(f"CuPy's CUDA bindings are missing (pip install 'reflex-worker[cuda]'): {e}") from e
        _rt = rt
    return _rt


def rt_call(what: str, fn, *args):
    """Call a CuPy runtime binding, turning its exception into a typed engine error."""
    try:
        return fn(*args)
    except Exception as e:  # CUDARuntimeError and friends
        status = getattr(e, "status", None)
        cls = OutOfMemory if status == OUT_OF_MEMORY else CudaError
        raise cls(f"{what} failed: {e}") from e


# -- memory, streams ---------------------------------------------------------------------------------------


def malloc(n_bytes: int) -> int:
    """A device allocation of a whole number of 16-byte granules: kernels that stage weights (kernels/stage.cuh) read
    the granules that cover a span, so the last one of a buffer must lie inside it."""
    n = max(16, -(-n_bytes // 16) * 16)
    return rt_call(f"cudaMalloc({n_bytes} bytes)", runtime().malloc, n)


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


def stream_destroy(stream: int) -> None:
    rt_call("cudaStreamDestroy", runtime().streamDestroy, stream)


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


class Event:
    """A point in a stream's work that the host can wait for (no timing: cudaEventDisableTiming)."""

    def __init__(self):
        self.handle = rt_call("cudaEventCreateWithFlags", runtime().eventCreateWithFlags, 2)

    def record(self, stream: int) -> None:
        rt_call("cudaEventRecord", runtime().eventRecord, self.handle, stream)

    def wait(self) -> None:
        rt_call("cudaEventSynchronize", runtime().eventSynchronize, self.handle)

    def destroy(self) -> None:
        if self.handle:
            rt_call("cudaEventDestroy", runtime().eventDestroy, self.handle)
            self.handle = 0


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


def need_same_layout(wg: DeviceWeight, wu: DeviceWeight, what: str) -> None:
    """A fused pair's check (gate and up of a SwiGLU): one type, shape and row size, both 16-byte aligned."""
    if (wg.ggml_type, wg.rows, wg.cols, wg.row_bytes) != (wu.ggml_type, wu.rows, wu.cols, wu.row_bytes):
        raise CudaError(f"{what} weights differ: {wg.name} {wg.tag} {wg.rows}x{wg.cols}, {wu.name} {wu.tag} "
                        f"{wu.rows}x{wu.cols}")  # fmt: skip
    need_aligned_weight(wg)
    need_aligned_weight(wu)


# -- device arrays -----------------------------------------------------------------------------------------

_ITEMSIZE = {"f4": 4, "f2": 2, "i2": 2, "i4": 4, "i8": 8, "u1": 1, "u4": 4, "u8": 8}


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


class DeviceWeight:
    """A weight matrix on the device in its GGUF block layout: R rows of K values, `row_bytes` apart."""

    def __init__(self, ptr_: int, ggml_type: int, rows: int, cols: int, row_bytes: int, name: str = ""):
        if int(ggml_type) not in KERNEL_TAGS:
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
        """The kernel-name suffix of this weight type (engine/quants.py KERNEL_TAGS, kernels/README.md)."""
        return KERNEL_TAGS[self.ggml_type]
