"""The CUDA context's thread (engine/cuda/context.py) without a GPU: its jobs in order, the early weight upload on a
thread of its own beside them, a failed context, and who owns an early upload: the loader that takes it (only an
upload of the file it opened), or, when the load goes another way (an error, the CPU backend, a worker that failed to
load), whichever thread sees it last frees it, without the dropping thread waiting for it."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from engine import cuda, files, gguf, prepare
from engine.config import ModelConfig
from engine.cuda import context, driver, upload
from engine.errors import CudaError, GGUFError
from tests.test_early_upload import MODEL, fake  # noqa: F401  (the fixture)


class Held:
    """An upload stand-in: which thread freed it, how often."""

    def __init__(self):
        self.freed_on: list[str] = []

    def free(self) -> None:
        self.freed_on.append(threading.current_thread().name)


def ended(starter: context.ContextStarter) -> bool:
    starter._thread.join(5)
    return not starter._thread.is_alive()


def test_jobs_run_in_order_on_the_context_thread_and_preload_is_the_last(fake, monkeypatch):  # noqa: F811
    loaded: list[str] = []
    monkeypatch.setattr(driver, "module", loaded.append)
    starter = context.ContextStarter(5)
    ran_on: dict[str, str] = {}
    first = starter.submit(lambda: ran_on.setdefault("first", threading.current_thread().name) and "a")
    starter.upload_early(lambda cancel: ran_on.setdefault("upload", threading.current_thread().name) and "b",
                         then=("matvec",))  # fmt: skip
    starter.preload(("matvec", "attention"))
    late = starter.submit(lambda: ran_on.setdefault("late", "?"))
    assert first.result() == "a" and starter.take_upload(lambda u: True) == "b"
    with pytest.raises(CudaError, match="no more work"):
        late.result()
    assert ended(starter)
    assert ran_on == {"first": "cuda-context", "upload": "cuda-upload"}
    assert loaded == ["matvec", "matvec", "attention"] and fake.contexts == {5}


def test_the_early_upload_runs_beside_the_module_loads(fake, monkeypatch):  # noqa: F811
    """The upload does not wait for the modules the context's thread loads, nor they for it."""
    both = threading.Barrier(2, timeout=5)
    monkeypatch.setattr(driver, "module", lambda name: both.wait())
    starter = context.ContextStarter(0)

    def meets_a_module_load(cancel):
        starter.wait()
        both.wait()
        return "u"

    starter.upload_early(meets_a_module_load, then=("matvec",))
    starter.preload(())
    assert starter.take_upload(lambda u: True) == "u" and ended(starter)


def test_a_failed_context_fails_the_jobs_already_queued(monkeypatch):
    gate = threading.Event()

    def refuse(device: int = 0) -> None:
        gate.wait(5)
        raise CudaError("cuInit failed: planted")

    monkeypatch.setattr(driver, "start_context", refuse)
    starter = context.ContextStarter(0)
    starter.upload_early(lambda cancel: starter.wait() and pytest.fail("ran without a context"))  # waits for it
    gate.set()
    with pytest.raises(CudaError, match="planted"):
        starter.wait()
    assert starter.take_upload(lambda u: True) is None
    with pytest.raises(CudaError, match="planted"):
        starter.submit(lambda: None).result()


@pytest.mark.parametrize("accept", [True, False])
def test_the_loader_takes_an_upload_it_accepts_and_frees_one_it_refuses(fake, accept):  # noqa: F811
    starter = context.ContextStarter(0)
    held = Held()
    starter.upload_early(lambda cancel: held)
    assert (starter.take_upload(lambda u: accept) is held) is accept
    assert held.freed_on == ([] if accept else ["MainThread"])
    starter.abandon()
    assert ended(starter) and len(held.freed_on) == (0 if accept else 1)  # abandon after a take frees nothing


def test_abandon_frees_a_finished_upload_at_once(fake):  # noqa: F811
    starter = context.ContextStarter(0)
    held = Held()
    starter.upload_early(lambda cancel: held)
    starter._upload.job.result()  # the upload has finished
    starter.abandon()
    assert held.freed_on == ["MainThread"] and ended(starter)


def test_abandon_does_not_wait_for_an_upload_in_flight_which_stops_and_frees_itself(fake):  # noqa: F811
    starter = context.ContextStarter(0)
    held = Held()
    running, cancelled = threading.Event(), []

    def slow(cancel: threading.Event):
        running.set()
        cancelled.append(cancel.wait(5))  # as the pipeline does between its pieces
        return held

    starter.upload_early(slow)
    early = starter._upload
    running.wait(5)
    t0 = time.perf_counter()
    starter.abandon()
    assert time.perf_counter() - t0 < 0.1
    assert ended(starter) and early.job.result() is None  # freed on its own thread, not handed to anyone
    assert cancelled == [True] and held.freed_on == ["cuda-upload"]


def test_abandon_fails_the_jobs_still_queued(fake, monkeypatch):  # noqa: F811
    """Modules queued for a context nobody will use are not loaded once the context exists."""
    gate, loaded = threading.Event(), []
    created = driver.start_context
    monkeypatch.setattr(driver, "start_context", lambda device=0: gate.wait(5) and created(device))
    monkeypatch.setattr(driver, "module", loaded.append)
    starter = context.ContextStarter(0)
    starter.preload(("matvec", "attention"))
    queued = starter._jobs[0]
    starter.abandon()
    gate.set()
    with pytest.raises(CudaError, match="given up"):
        queued.result()
    assert ended(starter) and loaded == []


def test_a_refusal_that_raises_still_frees_the_upload(fake):  # noqa: F811
    starter = context.ContextStarter(0)
    held = Held()
    starter.upload_early(lambda cancel: held)

    def broken(upload):
        raise GGUFError("planted")

    with pytest.raises(GGUFError, match="planted"):
        starter.take_upload(broken)
    assert held.freed_on == ["MainThread"]
    starter.abandon()


def test_a_failed_early_upload_leaves_the_upload_to_the_loader(fake, caplog):  # noqa: F811
    starter = context.ContextStarter(0)

    def fail(cancel):
        raise CudaError("cudaMalloc failed: planted")

    starter.upload_early(fail)
    with caplog.at_level("INFO", logger="engine.cuda.context"):
        assert starter.take_upload(lambda u: True) is None
    assert "planted" in caplog.text
    starter.abandon()


def test_abandon_never_raises(fake):  # noqa: F811
    class Broken:
        def free(self) -> None:
            raise CudaError("cudaFree failed: planted")

    starter = context.ContextStarter(0)
    starter.upload_early(lambda cancel: Broken())
    starter._upload.job.result()
    starter.abandon()
    assert ended(starter)


# -- the loader's side -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["same", "other"])
def test_load_runner_takes_only_an_upload_of_the_file_it_opened(tmp_path, fake, monkeypatch, which):  # noqa: F811
    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)
    prepare.write_cache(path)
    other = str(tmp_path / "other.gguf")
    shutil.copy(path, other)
    prepare.write_cache(other)
    monkeypatch.setattr(driver, "module", lambda name: None)
    monkeypatch.setattr(cuda, "_prestarted", None)
    monkeypatch.setattr("engine.cuda.k_gemm.reserve", lambda: None)
    given = []

    class Stop(Exception):
        pass

    def weights(gf, stream, device=0, upload=None):
        given.append(upload and (upload.path, upload.base))
        raise Stop

    monkeypatch.setattr(upload, "DeviceWeights", weights)
    starter = context.ContextStarter(0)
    read = path if which == "same" else other
    starter.upload_early(lambda cancel: upload.early(read, files.cached_data_span(read)[0], 0, cancel))
    gf = prepare.open_model(path).file
    with pytest.raises(Stop):
        cuda.load_runner(ModelConfig.from_gguf(gf.metadata, gf.tensors), gf, 64, starter)
    freed = fake.mine()
    assert len(given) == 1 and len(freed) == 1  # freed once: by the failed load, or refused
    if which == "same":
        assert given[0] == (path, freed[0])
    else:
        assert given[0] is None  # the other file's upload: freed, not used
    assert ended(starter)


def test_the_engine_abandons_the_context_when_it_falls_back_to_the_cpu(tmp_path, monkeypatch):
    from engine import engine as engine_module

    class Starter:
        device, abandoned = 0, 0

        def preload(self, names):
            pass

        def wait(self):
            raise CudaError("cuInit failed: planted")

        def abandon(self):
            self.abandoned += 1

    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)
    starter = Starter()
    monkeypatch.setattr(engine_module, "_start_backend", lambda backend: ("auto", starter))
    eng = engine_module.Engine.load(path, max_seq_len=64)
    assert eng.backend == "cpu" and starter.abandoned >= 1


def test_the_cpu_backend_and_a_failed_load_let_a_prestarted_context_go(tmp_path, monkeypatch):
    from engine.engine import Engine
    from engine.worker.service import Worker

    class Starter:
        abandoned = 0

        def abandon(self):
            self.abandoned += 1

    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)

    def missing() -> None:
        with pytest.raises(GGUFError):
            Engine.load(str(tmp_path / "missing.gguf"), backend="cuda")

    for load in (lambda: Engine.load(path, backend="cpu", max_seq_len=64),
                 lambda: Worker.load(env={"MODEL_NAME": "not a repo"}), missing):  # fmt: skip
        starter = Starter()
        monkeypatch.setattr(cuda, "_prestarted", starter)
        load()
        assert starter.abandoned == 1 and cuda._prestarted is None


def test_the_identity_of_a_file_is_recorded_where_it_is_opened(tmp_path):
    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)
    read = gguf.read(path).identity
    prepare.write_cache(path)
    cached = prepare.open_model(path).file.identity
    assert read is not None and read == cached


def test_weights_are_freed_when_the_model_fails_to_build(tmp_path, fake, monkeypatch):  # noqa: F811
    import engine.models.dense_cuda as dense

    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)
    monkeypatch.setattr(driver, "module", lambda name: None)
    monkeypatch.setattr("engine.cuda.k_gemm.reserve", lambda: None)

    class Weights:
        freed = 0

        def __init__(self, gf, stream, device=0, upload=None):
            pass

        def free(self) -> None:
            Weights.freed += 1

    def fail(*args):
        raise CudaError("cudaMalloc failed: planted")

    monkeypatch.setattr(upload, "DeviceWeights", Weights)
    monkeypatch.setattr(dense, "CudaModel", fail)
    gf = gguf.read(path)
    with pytest.raises(CudaError, match="planted"):
        cuda.load_runner(ModelConfig.from_gguf(gf.metadata, gf.tensors), gf, 64, context.ContextStarter(0))
    assert Weights.freed == 1
