"""Caches whose memory is mapped as positions are used: the address range of the whole (layers, max_seq, ...) array is
reserved up front (so every pointer a launch list or a CUDA graph holds stays valid), and physical memory is mapped
under it by the driver's virtual memory management (cuMemCreate / cuMemMap) when a sequence first reaches a row.

A model of 4,096 positions then holds what its longest sequence so far needed (a system1 job of 13 tokens: 256
rows a layer) instead of every row from the start; a long context costs only when it is used. Rows are mapped for
each layer (axis 0) from row 0 up, growing to the next power of two; nothing is unmapped until the array is freed.
Where the device has no virtual memory management, or REFLEX_KV_BY_NEED=0, the array is one allocation up front.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import NamedTuple

from engine.cuda import driver
from engine.cuda.memory import DeviceArray, malloc
from engine.errors import CudaError, OutOfMemory

_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3  # CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, PROT_READWRITE
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
MIN_ROWS = 256  # rows a layer mapped at the first use


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp (allocFlags: compression, RDMA, usage, reserved)
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", _Location),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]  # fmt: skip


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _call(result: int, what: str) -> None:
    if result == _OUT_OF_MEMORY:
        raise OutOfMemory(f"{what}: out of device memory")
    driver.check(result, what)


_granularity: dict[int, int] = {}


def granularity(device: int = 0) -> int:
    """The mapping granularity of device memory in bytes (2 MiB on current GPUs); 0 where the device cannot map
    memory on demand."""
    g = _granularity.get(device)
    if g is None:
        lib, g = driver.libcuda(), 0
        if driver.attribute(_VMM_SUPPORTED, device):
            size = ctypes.c_size_t()
            _call(lib.cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(_prop(device)), 0),
                  "cuMemGetAllocationGranularity")  # fmt: skip
            g = size.value
        _granularity[device] = g
    return g


def _prop(device: int) -> _Prop:
    return _Prop(type=_PINNED, location=_Location(_ON_DEVICE, device))


class ByNeedArray(DeviceArray):
    """A (layers, rows, ...) device array whose rows are mapped on demand (`ensure`). Views, launches and graphs may
    hold its addresses from the start; a kernel may touch only rows below `mapped_rows`."""

    def __init__(self, shape: tuple[int, ...], dtype: str, device: int):
        super().__init__(0, shape, dtype, owner=False)
        self.device = device
        self.gran = granularity(device)
        self.layer_bytes = self.nbytes // self.shape[0]
        self.row_bytes = self.layer_bytes // self.shape[1]
        self.span = -(-self.nbytes // self.gran) * self.gran
        base = ctypes.c_uint64()
        _call(driver.libcuda().cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(self.span),
                                                   ctypes.c_size_t(self.gran), ctypes.c_uint64(0), ctypes.c_uint64(0)),
              f"cuMemAddressReserve({self.span} bytes)")  # fmt: skip
        self.ptr = base.value
        self._pages: set[int] = set()  # granules mapped, by index from ptr
        self._handles: list[tuple[int, int, int]] = []  # (handle, address, bytes) of every mapping
        self.mapped_rows = 0

    @property
    def mapped_bytes(self) -> int:
        return len(self._pages) * self.gran

    def ensure(self, rows: int) -> None:
        """Map rows 0..rows-1 of every layer (rounded up to a power of two, MIN_ROWS at least, the array's rows at
        most). Raises OutOfMemory, with what was mapped before still mapped, when the device has no room."""
        if rows <= self.mapped_rows:
            return
        want = min(self.shape[1], max(MIN_ROWS, 1 << (rows - 1).bit_length()))
        for layer in range(self.shape[0]):
            start = layer * self.layer_bytes
            first, end = start // self.gran, -(-(start + want * self.row_bytes) // self.gran)
            page = first
            while page < end:  # each run of unmapped granules in one mapping
                if page in self._pages:
                    page += 1
                    continue
                run = page
                while run < end and run not in self._pages:
                    run += 1
                self._map(page, run - page)
                page = run
        self.mapped_rows = want

    def _map(self, page: int, n: int) -> None:
        lib, size = driver.libcuda(), n * self.gran
        address, handle = self.ptr + page * self.gran, ctypes.c_uint64()
        _call(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(_prop(self.device)),
                              ctypes.c_uint64(0)), f"cuMemCreate({size} bytes)")  # fmt: skip
        try:
            _call(lib.cuMemMap(ctypes.c_uint64(address), ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                               ctypes.c_uint64(0)), "cuMemMap")  # fmt: skip
        except CudaError:
            lib.cuMemRelease(handle)
            raise
        self._handles.append((handle.value, address, size))
        access = _Access(_Location(_ON_DEVICE, self.device), _READ_WRITE)
        _call(lib.cuMemSetAccess(ctypes.c_uint64(address), ctypes.c_size_t(size), ctypes.byref(access),
                                 ctypes.c_size_t(1)), "cuMemSetAccess")  # fmt: skip
        self._pages.update(range(page, page + n))

    def _host_side(self, *_) -> None:
        raise CudaError("a by-need cache is read and written by kernels only (its unmapped rows have no memory)")

    fill_byte = to_host = copy_from_host = _host_side

    def free(self) -> None:
        if not self.ptr:
            return
        lib = driver.libcuda()
        for handle, address, size in self._handles:
            lib.cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(size))
            lib.cuMemRelease(ctypes.c_uint64(handle))
        lib.cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.span))
        self._handles, self._pages, self.ptr, self.mapped_rows = [], set(), 0, 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the context may already be gone
            self.free()


class UpFrontArray(DeviceArray):
    """The same interface over one allocation of every row (no virtual memory management, or REFLEX_KV_BY_NEED=0)."""

    def __init__(self, shape: tuple[int, ...], dtype: str):
        super().__init__(0, shape, dtype, owner=True)
        self.ptr = malloc(self.nbytes)
        self.mapped_rows = self.shape[1]

    @property
    def mapped_bytes(self) -> int:
        return self.nbytes

    def ensure(self, rows: int) -> None:
        pass


def cache(shape: tuple[int, ...], dtype: str = "f4", device: int = 0) -> ByNeedArray | UpFrontArray:
    """A (layers, rows, ...) cache: rows mapped by need where the device allows it (the first MIN_ROWS of each
    layer at once, so that a short first request maps nothing), else allocated up front."""
    if os.environ.get("REFLEX_KV_BY_NEED", "1") != "0" and granularity(device):
        a = ByNeedArray(shape, dtype, device)
        a.ensure(MIN_ROWS)
        return a
    return UpFrontArray(shape, dtype)


class StateArray(NamedTuple):
    """One array of a state file (engine/state.py) as the device holds it."""

    name: str
    dtype: str  # "f4", "f2"
    shape: tuple[int, ...]  # as the file holds it
    runs: list[tuple[int, int]]  # device (address, bytes) segments, in C order
    positional: bool  # indexed by position (K/V rows), not overwritten by every token (recurrent state)


def position_rows(name: str, cache: DeviceArray, n: int) -> StateArray:
    """Rows 0..n-1 of every layer of a (layers, max_seq, ...) cache: one contiguous run a layer."""
    layers, rows = cache.shape[0], cache.shape[1]
    row_bytes = cache.nbytes // (layers * rows)
    runs = [(cache.ptr + i * rows * row_bytes, n * row_bytes) for i in range(layers)]
    return StateArray(name, cache.dtype, (layers, n, *cache.shape[2:]), runs, True)


def ensure_rows(caches, rows: int) -> None:
    """Every cache of a model with rows 0..rows-1 of each layer mapped."""
    for c in caches:
        c.ensure(rows)
