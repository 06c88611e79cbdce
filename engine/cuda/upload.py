"""Weights to the device in one copy: the GGUF tensor data section, unchanged, in one allocation.

The file is mapped read-only with libc's mmap and the mapping is page-locked in place (cudaHostRegister, read-only
flag), so a single DMA copy moves it at full PCIe speed without a pinned staging buffer; where registering fails
(some containers) the copy runs from pageable memory instead. Each tensor is then a pointer into the allocation
at its offset in the file, so quantized blocks reach the kernels exactly as llama.cpp's files store them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os

from engine.cuda import memory
from engine.errors import CudaError
from engine.gguf import GGUFFile, TensorInfo
from engine.quants import BLOCK_SIZES
from engine.timing import Stopwatch

log = logging.getLogger(__name__)

_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = ctypes.c_void_p(-1).value


class DeviceWeights:
    """The tensor data section of `gf` on the device: `.ptr(name)`, `.matrix(name)`; upload timings in `.stats`."""

    def __init__(self, gf: GGUFFile, stream: int):
        self.gf = gf
        start = gf.data_offset
        self.n_bytes = max(0, gf.size - start)
        self.base = memory.malloc(self.n_bytes)
        self.stats: dict[str, float | bool] = {}
        with Stopwatch() as sw:
            self._copy(start, stream)
        self.stats.update(upload_ms=sw.ms, upload_gb_per_s=self.n_bytes / max(sw.ms, 1e-6) / 1e6)

    def _copy(self, start: int, stream: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fd = os.open(self.gf.path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, self.gf.size, _PROT_READ, _MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, _MAP_FAILED):
            raise CudaError(f"mmap of {self.gf.path} failed (errno {ctypes.get_errno()})")
        try:
            with Stopwatch() as reg:
                try:
                    memory.host_register(addr, self.gf.size)
                    registered = True
                except CudaError as e:
                    log.info("copying from pageable memory: %s", e)
                    registered = False
            self.stats.update(host_register_ms=reg.ms, registered=registered)
            memory.memcpy_async(self.base, addr + start, self.n_bytes, memory.H2D, stream)
            memory.synchronize(stream)
            if registered:
                memory.host_unregister(addr)
        finally:
            libc.munmap(addr, self.gf.size)

    def ptr(self, info: TensorInfo) -> int:
        return self.base + (info.offset - self.gf.data_offset)

    def matrix(self, info: TensorInfo) -> memory.DeviceWeight:
        """A 2-D weight (GGUF ne [K, R]) as the kernels see it."""
        cols, rows = info.ne[0], info.ne[1] if len(info.ne) > 1 else 1
        block, size = BLOCK_SIZES[info.ggml_type]
        return memory.DeviceWeight(self.ptr(info), info.ggml_type, rows, cols, cols // block * size, info.name)

    def vector(self, info: TensorInfo) -> memory.DeviceArray:
        """A float32 vector (norm weights) as a view into the allocation."""
        if info.ggml_type != 0:
            raise CudaError(f"{info.name}: expected an F32 vector, found type {info.ggml_type.name}")
        return memory.DeviceArray(self.ptr(info), (info.n_elements,), "f4", owner=False)

    def tensor(self, info: TensorInfo) -> memory.DeviceWeight | memory.DeviceArray:
        """A 1-D tensor as an F32 vector, anything else as a matrix."""
        return self.vector(info) if len(info.ne) == 1 else self.matrix(info)

    def free(self) -> None:
        if self.base:
            memory.free(self.base)
            self.base = 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the context may already be gone
            self.free()
