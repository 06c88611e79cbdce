"""The weight upload on the CUDA context's thread before the model is opened (engine/cuda.upload_early): the context
thread's job order, the data offset read from the prepare cache, which upload the loader takes and which it frees,
and where the CLI and the worker find the model that early. The CUDA calls are host fakes (tests/test_upload_pieces.py);
the last test does it on the device."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading

import pytest

from engine import cuda, gguf, prepare
from engine.cuda import context, driver, memory, upload
from engine.errors import CudaError, GGUFError
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
    """The memory layer and the context on the host; `f.freed` lists freed allocations."""
    f = FakeCuda()
    f.freed = []
    for name in ("malloc", "memcpy_async", "host_register", "host_unregister"):
        monkeypatch.setattr(memory, name, getattr(f, name))
    monkeypatch.setattr(memory, "synchronize", lambda stream: None)
    monkeypatch.setattr(memory, "stream_create", lambda: 7)
    monkeypatch.setattr(memory, "stream_destroy", lambda stream: None)
    monkeypatch.setattr(memory, "free", f.freed.append)
    monkeypatch.setattr(memory, "Event", f.Event)
    monkeypatch.setattr(driver, "start_context", f.start_context)
    return f


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
    up = upload.early(model)
    gf = gguf.read(model)
    assert ctypes.string_at(up.base, up.n_bytes) == section(model)
    assert up.matches(gf) and not fake.locked
    link = str(tmp_path / "link.gguf")
    os.symlink(model, link)
    assert up.matches(gguf.read(link))  # the same file under another name
    w = upload.DeviceWeights(gf, stream=0, upload=up)
    base = up.base
    assert (w.base, w.n_bytes, w.stats["upload_ms"]) == (base, up.n_bytes, up.stats["upload_ms"])
    w.free()
    w.free()
    assert fake.freed == [base] and up.base == 0  # freed once


def test_an_upload_of_another_file_or_offset_is_not_taken(model, fake, tmp_path):
    up = upload.early(model)
    other = str(tmp_path / "other.gguf")
    shutil.copy(MODEL, other)
    assert not up.matches(gguf.read(other))  # same bytes, another file
    gf = gguf.read(model)
    gf.data_offset += 32
    assert not up.matches(gf)
    os.utime(model, ns=(1, 1))  # the file as it is now is not the one that was read
    assert not up.matches(gguf.read(model))
    assert upload.early(str(tmp_path / "missing.gguf")) is None


# -- the context thread --------------------------------------------------------------------------------------------


def test_jobs_run_in_order_on_the_context_thread_and_preload_is_the_last(fake, monkeypatch):
    loaded: list[str] = []
    monkeypatch.setattr(driver, "module", loaded.append)
    starter = context.ContextStarter(5)
    order: list[str] = []
    first = starter.submit(lambda: order.append(threading.current_thread().name) or "a")
    starter.upload_early(lambda: order.append("upload") or "b")
    starter.preload(("matvec", "attention"))
    late = starter.submit(lambda: order.append("late"))
    assert first.result() == "a" and starter.take_upload(lambda u: True) == "b"
    with pytest.raises(CudaError, match="no more work"):
        late.result()
    starter._thread.join(5)
    assert not starter._thread.is_alive()
    assert order == ["cuda-context", "upload"] and loaded == ["matvec", "attention"] and fake.contexts == {5}


def test_a_failed_context_fails_its_jobs_and_the_loader_uploads_itself(monkeypatch):
    def refuse(device: int = 0) -> None:
        raise CudaError("cuInit failed: planted")

    monkeypatch.setattr(driver, "start_context", refuse)
    starter = context.ContextStarter(0)
    starter.upload_early(lambda: pytest.fail("ran without a context"))
    with pytest.raises(CudaError, match="planted"):
        starter.wait()
    assert starter.take_upload(lambda u: True) is None
    with pytest.raises(CudaError, match="planted"):
        starter.submit(lambda: None).result()


class Held:
    def __init__(self):
        self.freed = 0

    def free(self) -> None:
        self.freed += 1


def test_a_refused_upload_is_freed_and_an_accepted_one_is_not(fake):
    for accept, freed in ((True, 0), (False, 1)):
        starter = context.ContextStarter(0)
        held = Held()
        starter.upload_early(lambda h=held: h)
        got = starter.take_upload(lambda u, a=accept: a)
        assert (got is held) is accept and held.freed == freed
        starter.abandon()
        starter._thread.join(5)
        assert not starter._thread.is_alive()


def test_abandon_frees_an_upload_nobody_took_and_ends_the_thread(fake):
    starter = context.ContextStarter(0)
    held = Held()
    gate = threading.Event()
    starter.upload_early(lambda: gate.wait(5) and held)
    gate.set()
    starter.abandon()
    starter._thread.join(5)
    assert held.freed == 1 and not starter._thread.is_alive()


def test_a_failed_early_upload_leaves_the_upload_to_the_loader(fake, caplog):
    starter = context.ContextStarter(0)

    def fail():
        raise CudaError("cudaMalloc failed: planted")

    starter.upload_early(fail)
    with caplog.at_level("INFO", logger="engine.cuda.context"):
        assert starter.take_upload(lambda u: True) is None
    assert "planted" in caplog.text
    starter.abandon()


def test_upload_early_is_a_no_op_without_a_started_context_or_when_switched_off(fake, monkeypatch, model):
    monkeypatch.setattr(cuda, "_prestarted", None)
    cuda.upload_early(model)  # nothing started: nothing happens
    starter = context.ContextStarter(0)
    monkeypatch.setattr(cuda, "_prestarted", starter)
    monkeypatch.setenv("REFLEX_EARLY_UPLOAD", "0")
    cuda.upload_early(model)
    assert starter._upload is None
    monkeypatch.delenv("REFLEX_EARLY_UPLOAD")
    cuda.upload_early(model)
    up = starter.take_upload(lambda u: u.matches(gguf.read(model)))
    assert ctypes.string_at(up.base, up.n_bytes) == section(model)
    starter.abandon()


def test_the_engine_abandons_the_context_when_it_falls_back_to_the_cpu(model, monkeypatch):
    from engine import engine as engine_module

    class Starter:
        device, abandoned = 0, 0

        def preload(self, names):
            pass

        def wait(self):
            raise CudaError("cuInit failed: planted")

        def take_upload(self, accept):
            return None

        def discard_upload(self):
            pass

        def abandon(self):
            self.abandoned += 1

    starter = Starter()
    monkeypatch.setattr(engine_module, "_start_backend", lambda backend: ("auto", starter))
    eng = engine_module.Engine.load(model, max_seq_len=64)
    assert eng.backend == "cpu" and starter.abandoned >= 1


def test_a_failed_load_abandons_the_context(tmp_path, monkeypatch):
    from engine import engine as engine_module

    class Starter:
        abandoned = 0

        def abandon(self):
            self.abandoned += 1

    starter = Starter()
    monkeypatch.setattr(engine_module, "_start_backend", lambda backend: ("cuda", starter))
    with pytest.raises(GGUFError):
        engine_module.Engine.load(str(tmp_path / "missing.gguf"))
    assert starter.abandoned == 1


# -- where the model is known early --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, started", [
    (["engine", "system1", "m.gguf", "prompt"], {"backend": None, "model": "m.gguf"}),
    (["engine", "generate", "m.gguf", "hi", "--backend", "cuda"], {"backend": "cuda", "model": "m.gguf"}),
    (["engine", "bench", "--backend=cpu", "m.gguf"], {"backend": "cpu", "model": None}),
    (["engine", "system1"], {"backend": None, "model": None}),
    (["engine", "prepare", "m.gguf"], {}),
    (["engine"], {}),
])  # fmt: skip
def test_the_cli_starts_the_context_with_its_model(monkeypatch, argv, started):
    seen: dict = {}
    monkeypatch.setattr(cuda, "prestart", lambda backend=None, model=None: seen.update(backend=backend, model=model))
    cuda.prestart_cli(argv)
    assert seen == started


def test_the_worker_finds_a_local_model_and_never_downloads(tmp_path, model):
    assert models.local_path({"MODEL_PATH": model}) == model
    env = {"MODEL_NAME": "org/not-here", "HF_HUB_CACHE": str(tmp_path / "hub"), "RUNPOD_MODEL_CACHE": str(tmp_path)}
    assert models.local_path(env, baked=str(tmp_path / "none.gguf")) is None  # a download: not this early
    assert models.local_path({"MODEL_NAME": "not a repo"}) is None  # an error: Worker.load reports it
    baked = str(tmp_path / "model.gguf")
    shutil.copy(MODEL, baked)
    assert models.local_path({}, baked=baked) == baked


def test_the_upload_holds_a_short_switch_interval_and_gives_it_back(fake, monkeypatch, model):
    """The main thread runs Python while the context's thread uploads: a short switch interval while it does
    (engine/gil.py), Python's again after, also when another holder (the worker's import thread) overlaps it."""
    import sys

    from engine import gil

    before = sys.getswitchinterval()
    seen = []
    early = upload.early
    monkeypatch.setattr(upload, "early", lambda path, device=0: seen.append(sys.getswitchinterval()) or early(path))
    starter = context.ContextStarter(0)
    monkeypatch.setattr(cuda, "_prestarted", starter)
    assert gil.hold()  # another holder, released while the upload still holds
    cuda.upload_early(model)
    gil.release()
    assert starter.take_upload(lambda u: True) is not None
    starter.abandon()
    assert seen == [gil.SWITCH_MS / 1000] and sys.getswitchinterval() == before
