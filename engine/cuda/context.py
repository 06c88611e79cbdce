"""The CUDA context's thread: the primary context is created on it first thing in the process (engine/cuda.prestart),
then it runs the jobs handed to it, in order: the kernel modules every model runs and those of the model (preload), so
that they overlap the main thread's imports, model open and buffer set-up. The weight upload of a model known that
early (engine/cuda.upload_early) runs on a thread of its own beside it: it names the file and reads its cache at
once, and copies once the context exists, while the modules load.
"""

from __future__ import annotations

import os
import threading

from engine.cuda import driver
from engine.errors import CudaError


class Job:
    """A function to run on the context's thread, and its outcome (`result()` waits for it and raises its error). No
    concurrent.futures here: this module is imported before the heavy imports (prestart), and that one brings
    logging and re with it."""

    def __init__(self, fn):
        self.fn = fn
        self.value = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # the job's owner decides what it means
            self.error = e
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def result(self):
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class EarlyUpload:
    """The weight upload a ContextStarter runs before the model is opened (fn(cancel) -> an engine/cuda/upload.Upload
    or None, on a thread of its own, started at once: fn waits for the context itself, ContextStarter.wait), and who
    owns it: the loader that takes it (take), or, when the load goes another way (drop), whoever sees it last frees
    it: the upload's thread when the upload is still running then, the dropping thread when it is done. Exactly one of
    them does (the claim is made under one lock), and an upload still running stops at its next piece (cancel)."""

    def __init__(self, starter: ContextStarter, fn):
        self.device = starter.device
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._result = None  # the finished upload, until claimed
        self._claimed = False  # taken by the loader, or freed
        self._dropped = False
        self.job = Job(lambda: self._run(fn))
        threading.Thread(target=self.job.run, name="cuda-upload", daemon=True).start()

    def _run(self, fn):
        upload = fn(self.cancel)
        with self._lock:
            free = upload is not None and self._dropped and not self._claimed
            self._claimed = self._claimed or free
            if not free:
                self._result = upload
        if free:
            _free(upload)
            return None
        return upload

    def take(self, accept) -> object | None:
        """The upload if it succeeded, nobody dropped it and accept(upload) holds, else None (a refused upload is
        freed here). Waits for it to finish; the caller has the context current."""
        try:
            self.job.result()
        except Exception as e:  # the loader uploads in the usual way, and meets the same error there if it persists
            _log().info("the early weight upload failed (%s): uploading now", e)
            return None
        with self._lock:
            upload, self._result = self._result, None
            if upload is None or self._claimed:
                return None
            self._claimed = True
        try:
            taken = accept(upload)
        except BaseException:
            _free(upload)
            raise
        if taken:
            return upload
        _log().info("the early weight upload was of another file or offset: uploading now")
        _free(upload)
        return None

    def drop(self) -> None:
        """Nobody will take the upload: stop it, and free it here if it is done (else the thread does). Never raises
        and never waits for the upload."""
        self.cancel.set()
        with self._lock:
            self._dropped = True
            upload, self._result = (None, None) if self._claimed else (self._result, None)
            self._claimed = self._claimed or upload is not None
        if upload is not None:
            try:
                driver.start_context(self.device)  # this thread may not have made it current yet
            except Exception as e:  # no context: nothing of it to free either
                _log().info("the early weight upload is left to the process's end: %s", e)
                return
            _free(upload)


def _free(upload) -> None:
    try:
        upload.free()
    except Exception as e:  # a free that fails leaves the memory to the process's end, and the load goes on
        _log().warning("freeing the early weight upload failed: %s", e)


class ContextStarter:
    """Creates the primary context of `device` on a background thread; `wait()` returns its start-up time. Once the
    context exists the thread runs the jobs handed to it, in order: the kernel modules every model runs when the model
    is known early (`upload_early`, whose weight upload runs beside them on a thread of its own), then those named by
    `preload()` (the model's, known after the GGUF is open), so that all of it overlaps the main thread's imports,
    model open and buffer set-up."""

    def __init__(self, device: int = 0):
        self.device = device
        self.error: BaseException | None = None
        self.ms = 0.0
        self._started = threading.Event()
        self._jobs: list[Job] = []  # run in order on the thread once the context exists
        self._more = threading.Condition()
        self._closed = False  # preload() was the last job: later submits run nothing
        self._upload: EarlyUpload | None = None  # the early weight upload, until load_runner takes it
        self._thread = threading.Thread(target=self._run, name="cuda-context", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from engine.timing import Stopwatch

        try:
            with Stopwatch() as sw:
                driver.start_context(self.device)
            self.ms = sw.ms
        except BaseException as e:  # handed to the waiting thread, and to every job
            self.error = e
            self._close(fail=e)
            return
        finally:
            self._started.set()
        while True:
            with self._more:
                while not self._jobs and not self._closed:
                    self._more.wait()
                if not self._jobs:
                    return
                job = self._jobs.pop(0)
            job.run()

    def _close(self, fail: BaseException | None = None) -> None:
        with self._more:
            self._closed = True
            pending = self._jobs if fail is not None else []
            if fail is not None:
                self._jobs = []
            self._more.notify()
        for job in pending:
            job.fail(fail)

    def submit(self, fn) -> Job:
        """Run fn() on the context's thread once the context exists (after the jobs before it). After preload() (or
        a failed context) nothing more runs: the job fails at once."""
        job = Job(fn)
        with self._more:
            if not self._closed:
                self._jobs.append(job)
                self._more.notify()
                return job
        job.fail(self.error or CudaError("the CUDA context's thread takes no more work"))
        return job

    def upload_early(self, fn, then: tuple[str, ...] = ()) -> None:
        """Start the weight upload fn(cancel) (engine/cuda/upload.early; fn waits for the context: `wait`) on a thread
        of its own, and load the kernel modules `then` (those every model runs) on the context's thread meanwhile;
        load_runner takes the upload (take_upload)."""
        if self._upload is None:
            self._upload = EarlyUpload(self, fn)
            if then and os.environ.get("REFLEX_MODULE_PRELOAD", "1") != "0":
                self.submit(lambda: _load_modules(then))

    def take_upload(self, accept) -> object | None:
        """The early upload if there was one, it succeeded and accept(upload) holds, else None (a refused upload is
        freed). Waits for it to finish."""
        early, self._upload = self._upload, None
        return early.take(accept) if early is not None else None

    def abandon(self) -> None:
        """The model will not load on this context (an error, or the CPU backend instead): the thread takes no more
        work, and an early upload nobody took stops and is freed (by whichever thread sees it last). Never raises and
        never waits for the upload; the jobs still queued (kernel modules) fail unrun."""
        self._close(fail=CudaError("the CUDA load was given up"))
        early, self._upload = self._upload, None
        if early is not None:
            early.drop()

    def preload(self, names: tuple[str, ...]) -> None:
        """Load these kernel modules on the context's thread after its other jobs (REFLEX_MODULE_PRELOAD=0: on first
        use instead); the thread takes nothing more."""
        if os.environ.get("REFLEX_MODULE_PRELOAD", "1") != "0":
            self.submit(lambda: _load_modules(names))
        self._close()

    def ready(self) -> bool:
        """Whether the context's creation has ended (in a context, or in an error that `wait` raises)."""
        return self._started.is_set()

    def wait(self) -> float:
        self._started.wait()
        if self.error is not None:
            raise self.error
        # The runtime binds to the primary context the thread created; this thread must make it current too.
        driver.start_context(self.device)
        return self.ms


def _log():
    import logging  # here: this module is imported before the heavy imports

    return logging.getLogger(__name__)


def _load_modules(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            driver.module(name)
        except CudaError:  # raised again where the module is first used
            return
