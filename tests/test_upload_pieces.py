"""engine/cuda/upload.py's pipeline: the tensor data section reaches the allocation byte for byte whatever the piece
size, thread count or locking outcome; every lock taken is released, and only after its piece's copy was queued.
The CUDA calls are replaced by host fakes here (no GPU needed); the last test does the same on the device."""

from __future__ import annotations

import ctypes
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from engine.cuda import driver, memory, upload
from engine.errors import CudaError, InvalidInput

PAGE = upload._PAGE


class FakeCuda:
    """malloc / memcpy_async / host_register / host_unregister / Event on host memory, with a record of the calls."""

    def __init__(self, refuse_at: int | None = None, fail_copy_at: int | None = None):
        self.buffers: list = []
        self.locked: dict[int, int] = {}  # address -> bytes, currently locked
        self.lock_calls = 0
        self.copies: list[tuple[int, int]] = []  # (src, n) in order
        self.released_after: dict[int, int] = {}  # address -> copies queued when its Event was recorded
        self.refuse_at, self.fail_copy_at = refuse_at, fail_copy_at
        self.contexts: set[int] = set()
        self.mutex = threading.Lock()
        fake = self

        class Event:
            def __init__(self):
                self.after = None

            def record(self, stream: int) -> None:
                self.after = len(fake.copies)

            def wait(self) -> None:
                assert self.after is not None

            def destroy(self) -> None:
                pass

        self.Event = Event

    def malloc(self, n: int) -> int:
        buf = ctypes.create_string_buffer(max(16, n))
        self.buffers.append(buf)
        return ctypes.addressof(buf)

    def memcpy_async(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        assert kind == memory.H2D and n > 0
        if self.fail_copy_at is not None and len(self.copies) == self.fail_copy_at:
            raise CudaError("cudaMemcpyAsync failed: planted")
        ctypes.memmove(dst, src, n)
        self.copies.append((src, n))

    def host_register(self, ptr: int, n: int, read_only: bool = True) -> None:
        assert ptr % PAGE == 0, "a piece starts on a page"
        with self.mutex:
            self.lock_calls += 1
            if self.refuse_at is not None and self.lock_calls > self.refuse_at:
                raise CudaError("cudaHostRegister failed: planted refusal")
            for a, m in self.locked.items():
                assert ptr + n <= a or a + m <= ptr, "pieces overlap"
            self.locked[ptr] = n

    def host_unregister(self, ptr: int) -> None:
        with self.mutex:
            assert ptr in self.locked, "released a lock never taken"
            n = self.locked.pop(ptr)
            if self.fail_copy_at is None:  # the piece's copy was queued before its lock went
                assert any(ptr <= src < ptr + n for src, _ in self.copies)
            self.released_after[ptr] = n

    def start_context(self, device: int = 0) -> None:
        with self.mutex:
            self.contexts.add(device)

    def mine(self) -> list[int]:
        """Frees of this fake's allocations (an earlier test's upload collected now frees through the same fake)."""
        return [p for p in self.freed if p in {ctypes.addressof(b) for b in self.buffers}]

    def install(self, monkeypatch) -> FakeCuda:
        """engine.cuda.memory and the context on this fake: `freed` lists freed allocations, `streams` live ones."""
        self.freed, self.streams = [], set()
        for name in ("malloc", "memcpy_async", "host_register", "host_unregister"):
            monkeypatch.setattr(memory, name, getattr(self, name))
        monkeypatch.setattr(memory, "synchronize", lambda stream: None)
        monkeypatch.setattr(memory, "stream_create", lambda: self.streams.add(7) or 7)
        monkeypatch.setattr(memory, "stream_destroy", self.streams.discard)
        monkeypatch.setattr(memory, "free", self.freed.append)
        monkeypatch.setattr(memory, "Event", self.Event)
        monkeypatch.setattr(driver, "start_context", self.start_context)
        return self


@pytest.fixture
def fake(monkeypatch):
    def make(**kw) -> FakeCuda:
        return FakeCuda(**kw).install(monkeypatch)

    return make


def file_of(tmp_path, size: int, data_offset: int, seed: int) -> tuple[SimpleNamespace, bytes]:
    raw = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / f"w{seed}.gguf"
    path.write_bytes(raw)
    return SimpleNamespace(path=str(path), size=size, data_offset=data_offset), raw


def device_bytes(w: upload.DeviceWeights) -> bytes:
    return ctypes.string_at(w.base, w.n_bytes)


@pytest.mark.parametrize("threads", [0, 1, 2, 5])
@pytest.mark.parametrize("seed", range(6))
def test_every_byte_arrives(tmp_path, fake, monkeypatch, threads: int, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    chunk_pages = int(rng.integers(1, 4))
    monkeypatch.setattr(upload, "CHUNK_BYTES", chunk_pages * PAGE)
    monkeypatch.setenv("REFLEX_UPLOAD_THREADS", str(threads))
    size = int(rng.integers(PAGE // 2, 9 * PAGE))
    gf, raw = file_of(tmp_path, size, int(rng.integers(0, size)), seed)
    f = fake()
    w = upload.DeviceWeights(gf, stream=0, device=3)
    assert device_bytes(w) == raw[gf.data_offset :]
    assert not f.locked, "a lock was left taken"
    first = gf.data_offset - gf.data_offset % PAGE
    n_pieces = -(-(size - first) // (chunk_pages * PAGE))
    assert w.stats["upload_pieces"] == n_pieces
    assert f.lock_calls == (n_pieces if threads else 0)
    assert w.stats["registered"] is (threads > 0)
    assert f.contexts == ({3} if threads else set())  # the locking threads use the model's device


@pytest.mark.parametrize("refuse_at", [0, 1, 3])
def test_a_refused_lock_copies_the_rest_from_pageable_memory(tmp_path, fake, monkeypatch, refuse_at: int) -> None:
    monkeypatch.setattr(upload, "CHUNK_BYTES", PAGE)
    monkeypatch.setenv("REFLEX_UPLOAD_THREADS", "1")
    gf, raw = file_of(tmp_path, 7 * PAGE + 123, 200, refuse_at)
    f = fake(refuse_at=refuse_at)
    w = upload.DeviceWeights(gf, stream=0)
    assert device_bytes(w) == raw[200:]
    assert not f.locked and len(f.released_after) == refuse_at
    assert f.lock_calls == refuse_at + 1  # the pieces after the first refusal are not tried
    assert w.stats["registered"] is False


def test_a_failed_copy_releases_every_lock(tmp_path, fake, monkeypatch) -> None:
    monkeypatch.setattr(upload, "CHUNK_BYTES", PAGE)
    monkeypatch.setenv("REFLEX_UPLOAD_THREADS", "2")
    gf, _ = file_of(tmp_path, 9 * PAGE, 0, 7)
    f = fake(fail_copy_at=4)
    with pytest.raises(CudaError, match="planted"):
        upload.DeviceWeights(gf, stream=0)
    assert not f.locked, "a lock was left taken after the failed copy"
    assert f.lock_calls >= 5


def test_a_malformed_thread_count_is_a_typed_error(tmp_path, fake, monkeypatch) -> None:
    monkeypatch.setenv("REFLEX_UPLOAD_THREADS", "two")
    gf, _ = file_of(tmp_path, 3 * PAGE, 0, 1)
    fake()
    with pytest.raises(InvalidInput, match="REFLEX_UPLOAD_THREADS"):
        upload.DeviceWeights(gf, stream=0)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [0, 2])
def test_pieces_on_the_device(tmp_path, monkeypatch, threads: int) -> None:
    driver.start_context(0)
    monkeypatch.setattr(upload, "CHUNK_BYTES", 16 * PAGE)
    monkeypatch.setenv("REFLEX_UPLOAD_THREADS", str(threads))
    gf, raw = file_of(tmp_path, 100 * PAGE + 777, 1234, 11)
    stream = memory.stream_create()
    w = upload.DeviceWeights(gf, stream)
    try:
        out = np.empty(w.n_bytes, np.uint8)
        memory.memcpy(out.ctypes.data, w.base, w.n_bytes, memory.D2H)
        assert out.tobytes() == raw[1234:]
        assert w.stats["upload_pieces"] == 7 and w.stats["registered"] is (threads > 0)
    finally:
        w.free()
    assert os.path.exists(gf.path)
