"""Weights to the device: the GGUF tensor data section, unchanged, in one allocation.

The file is mapped read-only with libc's mmap and the mapping is page-locked in place (cudaHostRegister, read-only
flag), so DMA copies move it at full PCIe speed without a pinned staging buffer. Locking costs about as long as the
copy (an H200 host, 17.7 GB from the page cache: 620 ms to lock, then 540 ms to copy, one after the other), so the
section goes in pieces of CHUNK_BYTES: `REFLEX_UPLOAD_THREADS` threads lock pieces in file order while the stream
copies those already locked, and each lock is released, again on those threads, once its piece's copy has run (two
threads, 256 MiB pieces: 0.80-0.84 s for those 17.7 GB; one thread 0.90-1.11, four no faster, 64 MiB or 1 GiB pieces
a little slower; scripts/upload_bench.py). Where locking fails (some containers) the remaining pieces are copied from
pageable memory instead (2.0-2.4 s there). Each tensor is then a pointer into the allocation at its offset in the
file, so quantized blocks reach the kernels exactly as llama.cpp's files store them.

When the model is known at process start (the CLI's argument, the worker's local model) the upload runs on a thread of
its own as soon as the context exists (`early`, from the data offset the prepare cache records), beside the main
thread's imports and model open and the context thread's module loads; the loader takes it only if it `matches` the
file it opened.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine import files
from engine.cuda import driver, memory
from engine.errors import CudaError, GGUFError, env_int
from engine.quants import BLOCK_SIZES
from engine.timing import Stopwatch

if TYPE_CHECKING:  # not imported at run time: the upload's thread imports this module before the upload starts
    from engine.gguf import GGUFFile, TensorInfo

log = logging.getLogger(__name__)

_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = ctypes.c_void_p(-1).value
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CHUNK_BYTES = 256 << 20  # a piece locked and copied at a time (a multiple of the page size)
DEFAULT_UPLOAD_THREADS = 2  # threads locking pieces; 0: copy from pageable memory, nothing locked


class Upload:
    """Bytes [data_offset, end of file) of the file at `path` in one device allocation (`.base`, `.n_bytes`), with
    the upload's timings in `.stats`. It remembers which file it read (device, inode, size, modification time), so
    an upload started before the model was opened (`early`) is used only for that same file at that same offset."""

    def __init__(self, path: str, data_offset: int, stream: int, device: int = 0,
                 cancel: threading.Event | None = None):  # fmt: skip
        self.path = path
        self.device = device  # the locking threads make its primary context current
        self.data_offset = data_offset
        self.cancel = cancel  # set: stop before the next piece (Cancelled), freeing what was allocated
        self.base = 0
        self.stats: dict[str, float | bool] = {}
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self.identity = files.identity(st)
            self.n_bytes = max(0, self.size - data_offset)
            with Stopwatch() as alloc_sw:
                self.base = memory.malloc(self.n_bytes)
            with Stopwatch() as sw:
                self._copy(fd, stream)
        except BaseException:
            self.free()
            raise
        finally:
            os.close(fd)
        self.stats.update(weights_alloc_ms=alloc_sw.ms, upload_ms=sw.ms,
                          upload_gb_per_s=self.n_bytes / max(sw.ms, 1e-6) / 1e6)  # fmt: skip

    def matches(self, gf: GGUFFile) -> bool:
        """Whether this upload holds gf's tensor data: read from the file gf was opened from, unchanged since (device,
        inode, size, modification and change times), from the same offset."""
        identity = getattr(gf, "identity", None)
        return identity is not None and identity == self.identity and gf.data_offset == self.data_offset

    def _copy(self, fd: int, stream: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if self.n_bytes == 0:
            return
        addr = libc.mmap(None, self.size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise CudaError(f"mmap of {self.path} failed (errno {ctypes.get_errno()})")
        try:
            self._pipeline(addr, self.data_offset, stream)
        finally:
            libc.munmap(addr, self.size)

    def _pipeline(self, addr: int, start: int, stream: int) -> None:
        """Copy file bytes [start, size) at `addr` to the allocation, locking pieces ahead of the copies."""
        first = start - start % _PAGE  # pieces are page-aligned within the mapping
        piece = piece_bytes()
        pieces = [(a, min(a + piece, self.size)) for a in range(first, self.size, piece)]
        threads = env_int("REFLEX_UPLOAD_THREADS", DEFAULT_UPLOAD_THREADS)
        refused = threading.Event()  # set at the first failed lock: the pieces after it are not tried
        lock_ms: list[float] = []

        def lock(a: int, b: int) -> bool:
            if refused.is_set() or (self.cancel is not None and self.cancel.is_set()):
                return False  # a cancelled upload locks (and so reads off disk) nothing more
            with Stopwatch() as sw:
                try:
                    memory.host_register(addr + a, b - a)
                except CudaError as e:
                    log.info("copying from pageable memory: %s", e)
                    refused.set()
                    return False
            lock_ms.append(sw.ms)
            return True

        def release(a: int, copied: memory.Event) -> None:  # once the piece's copy has run
            try:
                copied.wait()
            finally:
                copied.destroy()
                memory.host_unregister(addr + a)

        pool = None
        if threads and pieces:
            pool = ThreadPoolExecutor(threads, "upload", initializer=driver.start_context, initargs=(self.device,))
        locks = [pool.submit(lock, a, b) for a, b in pieces] if pool else []
        releases: dict[int, Future] = {}  # piece start -> its release, submitted once its copy is queued
        done = False
        try:
            for i, (a, b) in enumerate(pieces):
                if self.cancel is not None and self.cancel.is_set():
                    raise Cancelled(f"the upload of {self.path} was cancelled")
                is_locked = bool(locks) and locks[i].result()  # locked, or refused: either way the piece can go
                lo = max(a, start)
                memory.memcpy_async(self.base + (lo - start), addr + lo, b - lo, memory.H2D, stream)
                if is_locked:
                    copied = memory.Event()
                    copied.record(stream)
                    releases[a] = pool.submit(release, a, copied)
            memory.synchronize(stream)
            done = True
        finally:
            if pool:  # every lock taken is released, also when a copy failed
                for (a, _), f in zip(pieces, locks, strict=True):
                    if a not in releases and f.exception() is None and f.result():
                        releases[a] = pool.submit(memory.host_unregister, addr + a)
                pool.shutdown()
        if done:
            for r in releases.values():
                r.result()  # a failed unlock is an error of the load
        self.stats.update(host_register_ms=sum(lock_ms), registered=bool(pieces) and len(lock_ms) == len(pieces),
                          upload_pieces=len(pieces))  # fmt: skip

    def free(self) -> None:
        if self.base:
            memory.free(self.base)
            self.base = 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the context may already be gone
            self.free()


class Cancelled(CudaError):
    """An early upload stopped because nobody will take it (engine/cuda/context.EarlyUpload.drop)."""


def piece_bytes() -> int:
    """Bytes a piece locks and copies at a time: CHUNK_BYTES, or REFLEX_UPLOAD_PIECE_MIB (for comparisons)."""
    mib = env_int("REFLEX_UPLOAD_PIECE_MIB", 0, minimum=0)
    return mib << 20 if mib else CHUNK_BYTES


def early(path: str, data_offset: int, device: int = 0, cancel: threading.Event | None = None) -> Upload:
    """The tensor data of the model at `path` on the device, uploaded before the model is opened (on a thread of its
    own, as soon as the context exists: engine/cuda.upload_early) from `data_offset`, which its prepare cache records
    (files.cached_data_span). The loader takes it only if it `matches` the opened file."""
    stream = memory.stream_create()
    try:
        return Upload(path, data_offset, stream, device, cancel)
    finally:
        memory.stream_destroy(stream)


class DeviceWeights:
    """The tensor data section of `gf` on the device: `.ptr(name)`, `.matrix(name)`; upload timings in `.stats`.
    `upload`: one already made for this file (early), else the section is uploaded here."""

    def __init__(self, gf: GGUFFile, stream: int, device: int = 0, upload: Upload | None = None):
        self.gf = gf
        self.upload = upload if upload is not None else Upload(gf.path, gf.data_offset, stream, device)
        opened = getattr(gf, "identity", None)
        if opened is not None and opened != self.upload.identity:  # gf's tensor table may not describe these bytes
            self.upload.free()
            raise GGUFError(f"{gf.path} changed between its open and its upload: load it again")
        self.base, self.n_bytes = self.upload.base, self.upload.n_bytes
        self.stats = self.upload.stats

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
        self.upload.free()
        self.base = 0
