"""CudaRunner's host side without a GPU: device memory is host memory behind a fake engine.cuda.memory, launches are
recorded, so the order of copies, launches and waits of a request can be checked on any machine."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

import pytest

from engine.cuda import driver, memory
from engine.cuda import runner as cuda_runner
from engine.cuda.memory import DeviceArray

B, VOCAB = 8, 50


class FakeMemory:
    """Allocations are ctypes buffers; copies run at once (a stream in order); every call is logged."""

    def __init__(self):
        self.log: list[tuple] = []
        self.buffers: list[ctypes.Array] = []

    def malloc(self, n: int) -> int:
        buf = (ctypes.c_char * max(16, n))()
        self.buffers.append(buf)
        return ctypes.addressof(buf)

    host_alloc = malloc

    def memcpy_async(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, n)
        self.log.append(("copy", kind, n))

    def synchronize(self, stream: int) -> None:
        self.log.append(("sync",))


class FakeModel:
    """What CudaRunner asks of a CudaModel for a forward and a gather; the gather 'kernel' writes logit = 0.5 * id."""

    def __init__(self, mem: FakeMemory):
        self.mem = mem
        self.cfg = SimpleNamespace(n_vocab=VOCAB)
        self.max_seq, self.max_batch, self.caches = 64, B, ()
        self.ctrl = DeviceArray.empty((4 + B,), "i4")

    def _launch(self, name: str, run=None):
        def launch(stream: int) -> None:
            self.mem.log.append(("launch", name))
            if run is not None:
                run()

        return launch

    def forward(self, n: int) -> list:
        return [self._launch(f"layer{i}") for i in range(3)]

    def head_gather(self, first: int, rows: int, vocab_ids: DeviceArray, n_out: int, out: DeviceArray, per_row: bool):
        def gather() -> None:
            ids = struct.unpack(f"{n_out}i", ctypes.string_at(vocab_ids.ptr, 4 * n_out))
            ctypes.memmove(out.ptr, struct.pack(f"{n_out}f", *(0.5 * i for i in ids)), 4 * n_out)

        return [self._launch("norm"), self._launch("gather_dot", gather)]


@pytest.fixture
def runner(monkeypatch):
    mem = FakeMemory()
    for name in ("malloc", "host_alloc", "memcpy_async", "synchronize"):
        monkeypatch.setattr(memory, name, getattr(mem, name))
    monkeypatch.setattr(memory, "free", lambda ptr: None)
    monkeypatch.setattr(memory, "host_free", lambda ptr: None)
    monkeypatch.setattr(driver, "start_context", lambda device=0: None)
    monkeypatch.setenv("REFLEX_CUDA_GRAPHS", "0")
    r = cuda_runner.CudaRunner(FakeModel(mem), stream=0)
    yield r, mem
    # Their memory is the fake's: nothing may reach the real cudaFree / cudaFreeHost once the patches are undone.
    r._ctrl_pinned = r.vocab_ids.ptr = r.gathered.ptr = r.model.ctrl.ptr = 0


def test_the_gather_of_a_prompt_follows_its_forward_without_a_wait(runner) -> None:
    r, mem = runner
    scores = r.forward([11, 12, 13], "last", [7, 3, 40])
    assert list(scores) == [3.5, 1.5, 20.0]
    assert r.position == 3
    kinds = [e[0] if e[0] != "launch" else e[1] for e in mem.log]
    # ctrl (waiting only for the previous copy from its staging), the forward, the ids, the gather, one final read
    assert kinds == ["sync", "copy", "layer0", "layer1", "layer2", "copy", "norm", "gather_dot", "copy", "sync"]


def test_gathered_ids_do_not_disturb_the_ctrl_mirror(runner) -> None:
    r, _ = runner
    r.forward([21, 22], "last", [1, 2, 3, 4])
    assert list(r._ctrl_host[4:6]) == [21, 22]  # the prompt's ids, as ctrl was uploaded
    assert list(r.forward([23], "last", [9])) == [4.5]
    assert r.position == 3


def test_more_candidates_than_a_batch_are_gathered_a_batch_at_a_time(runner) -> None:
    r, mem = runner
    vocab = [(7 * j) % VOCAB for j in range(2 * B + 3)]
    assert list(r.forward([5, 6], "last", vocab)) == [0.5 * t for t in vocab]
    piece = [("copy", memory.H2D, 4 * B), ("launch", "norm"), ("launch", "gather_dot"), ("copy", memory.D2H, 4 * B)]
    last = [("copy", memory.H2D, 12), ("launch", "norm"), ("launch", "gather_dot"), ("copy", memory.D2H, 12)]
    # pieces of B, B and 3 ids; the staging is rewritten only after the copy that reads it has run
    assert mem.log[-15:] == [*piece, ("sync",), *piece, ("sync",), *last, ("sync",)]


def test_every_row_gathers_its_own_id(runner) -> None:
    r, mem = runner
    assert list(r.forward([3, 4, 5], "all", [10, 20, 30])) == [5.0, 10.0, 15.0]
    assert mem.log[-5:] == [("copy", memory.H2D, 12), ("launch", "norm"), ("launch", "gather_dot"),
                            ("copy", memory.D2H, 12), ("sync",)]  # fmt: skip
