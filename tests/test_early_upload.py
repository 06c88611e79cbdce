"""The weight upload before the model is opened (engine/cuda.upload_early, engine/cuda/upload.early): the data offset
read from the prepare cache, the bytes that arrive, which file an upload counts as, cancellation, the GIL's switch
interval while it runs, and where the CLI and the worker find the model that early. The CUDA calls are host fakes
(tests/test_upload_pieces.py); the context thread's side is tests/test_context_thread.py, the device's
tests/test_cuda_context.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import threading

import pytest

from engine import cuda, files, gguf, gil, prepare
from engine.cuda import context, driver, memory, upload
from engine.errors import GGUFError
from engine.worker import models
from tests import conformance as C
from tests.test_upload_pieces import FakeCuda

MODEL = C.fixture_path("qwen3-tiny-q8_0", ".gguf")


@pytest.fixture
def model(tmp_path):
    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)
    prepare.write_cache(path)
    return path


@pytest.fixture
def fake(monkeypatch):
    """The memory layer and the context on the host (FakeCuda.install)."""
    return FakeCuda().install(monkeypatch)


def early(path: str, cancel: threading.Event | None = None) -> upload.Upload:
    """upload.early from the data offset the cache records, as upload_early's thread calls it."""
    return upload.early(path, prepare.cached_data_span(path)[0], 0, cancel)


def section(path: str) -> bytes:
    gf = gguf.read(path)
    with open(path, "rb") as fh:
        return fh.read()[gf.data_offset :]


# -- the data offset from the cache --------------------------------------------------------------------------------


def test_the_cache_gives_the_data_offset_and_size_the_parser_finds(model, tmp_path):
    gf = gguf.read(model)
    assert prepare.cached_data_span(model) == (gf.data_offset, gf.size)
    bare = str(tmp_path / "bare.gguf")
    shutil.copy(MODEL, bare)
    assert prepare.cached_data_span(bare) is None  # no cache: no early upload


@pytest.mark.parametrize("damage", ["garbage", "truncated", "huge_json", "other_size", "offset_past_end", "not_json"])
def test_a_damaged_cache_gives_no_span(model, damage):
    cache = prepare.cache_path(model)
    with open(cache, "rb") as f:
        data = bytearray(f.read())
    head = len(prepare.MAGIC)
    if damage == "garbage":
        data = bytearray(os.urandom(200))
    elif damage == "truncated":
        data = data[: head + 10]
    elif damage == "huge_json":
        data[head : head + 8] = (prepare.MAX_SECTION + 1).to_bytes(8, "little")
    elif damage == "other_size":
        with open(model, "ab") as f:
            f.write(b"\0" * 32)
    elif damage == "offset_past_end":
        at = data.index(b'"data_offset":') + len(b'"data_offset":')
        end = data.index(b",", at)
        data[at:end] = b"9" * (end - at + 3)
    else:
        at = head + prepare._PREAMBLE.size
        data[at] = ord("[")
    with open(cache, "wb") as f:
        f.write(data)
    assert prepare.cached_data_span(model) is None


# -- the upload and the file it is of ------------------------------------------------------------------------------


def test_the_early_upload_holds_the_tensor_data_and_matches_its_file(model, fake, tmp_path):
    up = early(model)
    gf = gguf.read(model)
    assert ctypes.string_at(up.base, up.n_bytes) == section(model)
    assert up.matches(gf) and not fake.locked and not fake.streams
    link = str(tmp_path / "link.gguf")
    os.symlink(model, link)
    assert up.matches(gguf.read(link))  # the same file under another name
    assert up.matches(prepare.open_model(model).file)  # opened through its cache
    w = upload.DeviceWeights(gf, stream=0, upload=up)
    base = up.base
    assert (w.base, w.n_bytes, w.stats["upload_ms"]) == (base, up.n_bytes, up.stats["upload_ms"])
    w.free()
    w.free()
    assert fake.mine() == [base] and up.base == 0  # freed once


def test_an_upload_of_another_file_or_offset_or_state_is_not_taken(model, fake, tmp_path):
    up = early(model)
    other = str(tmp_path / "other.gguf")
    shutil.copy(model, other)
    assert not up.matches(gguf.read(other))  # the same bytes, another file
    gf = gguf.read(model)
    gf.data_offset += 32
    assert not up.matches(gf)
    os.utime(model, ns=(1, 1))  # the file was changed after the upload read it
    assert not up.matches(gguf.read(model))
    up.free()


def test_a_file_changed_between_its_open_and_its_upload_is_refused(model, fake):
    gf = gguf.read(model)
    with open(model, "r+b") as f:  # same size, other bytes: gf's tensor table may no longer describe them
        f.seek(gf.data_offset)
        f.write(b"\x7f" * 64)
    with pytest.raises(GGUFError, match="changed between its open and its upload"):
        upload.DeviceWeights(gf, stream=0)
    assert len(fake.mine()) == 1 and not fake.locked


def test_a_cancelled_upload_stops_and_frees_what_it_took(model, fake, monkeypatch):
    monkeypatch.setattr(upload, "CHUNK_BYTES", upload._PAGE)
    monkeypatch.setenv("REFLEX_UPLOAD_THREADS", "2")
    cancel = threading.Event()
    real = fake.memcpy_async

    def copy_then_cancel(*args):
        real(*args)
        cancel.set()  # after the first piece

    locking = fake.host_register

    def slow_lock(*args):  # 1 ms a piece, as paging a piece in off disk takes: the pieces outlast the cancel
        threading.Event().wait(0.001)
        locking(*args)

    monkeypatch.setattr(memory, "memcpy_async", copy_then_cancel)
    monkeypatch.setattr(memory, "host_register", slow_lock)
    with pytest.raises(upload.Cancelled):
        early(model, cancel)
    assert len(fake.copies) == 1 and len(fake.mine()) == 1 and not fake.locked and not fake.streams
    pieces = -(-(os.path.getsize(model) - prepare.cached_data_span(model)[0]) // upload._PAGE)
    assert pieces > 100 and fake.lock_calls < 20  # the locking threads stopped too: the rest was not read


# -- upload_early ----------------------------------------------------------------------------------------------


@pytest.fixture
def starter(fake, monkeypatch):
    s = context.ContextStarter(0)
    monkeypatch.setattr(cuda, "_prestarted", s)
    monkeypatch.setattr(driver, "module", lambda name: None)
    yield s
    s.abandon()


def test_upload_early_is_a_no_op_without_a_context_a_model_or_when_switched_off(fake, monkeypatch, model):
    monkeypatch.setattr(cuda, "_prestarted", None)
    cuda.upload_early(model)  # nothing started: nothing happens
    s = context.ContextStarter(0)
    monkeypatch.setattr(cuda, "_prestarted", s)
    monkeypatch.setenv("REFLEX_EARLY_UPLOAD", "0")
    cuda.upload_early(model)
    monkeypatch.delenv("REFLEX_EARLY_UPLOAD")
    cuda.upload_early(None)
    assert s._upload is None
    s.abandon()


def test_the_model_may_be_named_on_the_upload_thread(starter, model):
    seen = []

    def local() -> str:
        seen.append(threading.current_thread().name)
        return model

    cuda.upload_early(local)
    up = starter.take_upload(lambda u: u.matches(gguf.read(model)))
    assert ctypes.string_at(up.base, up.n_bytes) == section(model) and seen == ["cuda-upload"]
    up.free()


def gated_upload(monkeypatch, gate: threading.Event, model: str) -> context.ContextStarter:
    """upload_early(model) on a prestarted context whose creation waits for `gate`."""
    created = driver.start_context
    monkeypatch.setattr(driver, "start_context", lambda device=0: gate.wait(5) and created(device))
    monkeypatch.setattr(driver, "module", lambda name: None)
    s = context.ContextStarter(0)
    monkeypatch.setattr(cuda, "_prestarted", s)
    cuda.upload_early(model)
    return s


def test_the_upload_thread_reads_the_cache_before_the_context_exists(fake, monkeypatch, model):
    """The upload's thread names the file and reads its cache's data span while the context is still being created;
    a model without a prepare cache gives no early upload at all."""
    asked, gate = [], threading.Event()
    span = files.cached_data_span
    monkeypatch.setattr(files, "cached_data_span", lambda path: asked.append(path) or span(path))
    s = gated_upload(monkeypatch, gate, model)
    for _ in range(500):
        if asked:
            break
        threading.Event().wait(0.01)
    assert asked == [model] and not fake.contexts  # no context yet
    gate.set()
    up = s.take_upload(lambda u: True)
    assert ctypes.string_at(up.base, up.n_bytes) == section(model)
    up.free()
    s.abandon()
    os.unlink(prepare.cache_path(model))
    s = context.ContextStarter(0)
    monkeypatch.setattr(cuda, "_prestarted", s)
    cuda.upload_early(model)
    assert s.take_upload(lambda u: True) is None and len(fake.mine()) == 1  # the first upload only


def test_the_upload_thread_reads_the_file_ahead_until_the_context_exists(fake, monkeypatch, model):
    """Asked to (REFLEX_PREFETCH=1), the upload's thread reads the tensor data ahead while the context is being
    created (files.prefetch), told to stop once the context exists; how much it read is in the upload's record."""
    monkeypatch.setenv("REFLEX_PREFETCH", "1")
    seen, gate = [], threading.Event()
    real = files.prefetch

    def spy(path, start, stop, chunk=files.PREFETCH_CHUNK):
        seen.append((path, start, stop, stop()))
        read = real(path, start, stop, chunk=4096)
        gate.set()  # the context only now: the whole section was read first
        return read

    monkeypatch.setattr(files, "prefetch", spy)
    s = gated_upload(monkeypatch, gate, model)
    up = s.take_upload(lambda u: True)
    gf = gguf.read(model)
    [(path, start, stop, stopped_before)] = seen
    assert (path, start, stopped_before) == (model, gf.data_offset, False)
    assert stop() and up.stats["prefetch_mib"] * 2**20 == gf.size - gf.data_offset  # the context exists: stop
    assert ctypes.string_at(up.base, up.n_bytes) == section(model)
    up.free()
    s.abandon()


def test_the_upload_holds_a_short_switch_interval_and_gives_it_back(starter, monkeypatch, model):
    """The main thread runs Python while the upload's thread uploads: a short switch interval while it does
    (engine/gil.py), Python's again after, also when another holder (the worker's import thread) overlaps it."""
    before = sys.getswitchinterval()
    seen = []
    early = upload.early
    monkeypatch.setattr(upload, "early", lambda *a: seen.append(sys.getswitchinterval()) or early(*a))
    assert gil.hold()  # another holder, released while the upload may still hold
    cuda.upload_early(model)
    gil.release()
    up = starter.take_upload(lambda u: True)
    assert up is not None
    up.free()
    assert seen == [gil.SWITCH_MS / 1000] and sys.getswitchinterval() == before


# -- where the model is known early --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, started", [
    (["engine", "system1", "m.gguf", "prompt"], {"backend": None, "model": "m.gguf"}),
    (["engine", "generate", "m.gguf", "hi", "--backend", "cuda"], {"backend": "cuda", "model": "m.gguf"}),
    (["engine", "system1", "--backend=cpu", "m.gguf"], {"backend": "cpu", "model": None}),
    (["engine", "bench", "m.gguf"], {"backend": None, "model": None}),  # it reads idle power and free memory first
    (["engine", "system1"], {"backend": None, "model": None}),
    (["engine", "prepare", "m.gguf"], {}),
    (["engine"], {}),
])  # fmt: skip
def test_the_cli_starts_the_context_with_its_model(monkeypatch, argv, started):
    seen: dict = {}
    monkeypatch.setattr(cuda, "prestart", lambda backend=None, model=None: seen.update(backend=backend, model=model))
    cuda.prestart_cli(argv)
    assert seen == started


def test_the_worker_finds_a_local_model_and_never_downloads(tmp_path, model, monkeypatch):
    def no_download(*args):
        raise AssertionError("local_path downloaded")

    monkeypatch.setattr(models, "_download", no_download)
    assert models.local_path({"MODEL_PATH": model}) == model
    env = {"MODEL_NAME": "org/not-here", "HF_HUB_CACHE": str(tmp_path / "hub"), "RUNPOD_MODEL_CACHE": str(tmp_path)}
    assert models.local_path(env, baked=str(tmp_path / "none.gguf")) is None  # a download: not this early
    assert models.local_path({"MODEL_NAME": "not a repo"}) is None  # an error: Worker.load reports it
    baked = str(tmp_path / "model.gguf")
    shutil.copy(MODEL, baked)
    assert models.local_path({}, baked=baked) == baked
