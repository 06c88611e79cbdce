"""Runpod glue for handler.py: the SDK imported off the cold path, outputs adapted to the SDK's rules, start-up.
In the platform's queue mode the worker runs engine/worker/job_loop.py instead, and imports no SDK at all
(`stdlib_job_loop` decides); what follows holds for the SDK's own modes and for REFLEX_JOB_LOOP=sdk.

Facts about runpod-python 1.12.0 this module exists for (serverless/README.md has the long form):
- `import runpod` costs ~1.5 s on a 2-core machine, ~1.1 s of it py-cpuinfo's `get_cpu_info()`, which
  `runpod/serverless/utils/rp_debugger.py` calls at import time; it starts a second Python interpreter to read the
  CPU brand, which is used only for `--rp_debugger` output. `RunpodImport` imports the SDK in a thread started
  first thing, overlapping the engine load, with a stand-in `cpuinfo` that reads the brand from /proc/cpuinfo.
- A generator handler's output dict with a truthy `error` ends the job FAILED with only `str(error)`: the error is
  sent as a JSON string of `{"error", "error_kind"}` so the kind survives. `refresh_worker` in a generator's
  output is ignored; the SDK reads `config["refresh_worker"]` after each job, so a CUDA fault sets it there.
- In `--test_input` / test_input.json mode the SDK does not iterate a generator handler (it prints the generator
  object); `start` hands it a collecting, non-generator form of the handler instead.
- The automatic start-up fitness checks (nvidia-smi runs, an 8.8.8.8 probe, a `gpu_test` binary, then
  `import cupy` and a CuPy matmul over random arrays, which needs NVRTC/cuRAND/cuBLAS — not in this image, and a
  RuntimeError there kills the worker) are switched off; the engine's own load is the GPU check, registered as a
  fitness check that fails when the model did not load.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import json
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from engine import gil, timing
from engine.worker.stand_in import stand_in

ENV_DEFAULTS = {
    "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
    "RUNPOD_SKIP_GPU_CHECK": "true",
    "RUNPOD_LOG_LEVEL": "INFO",  # the SDK's default, DEBUG, logs every streamed chunk
    # pydantic looks for plugins through every installed distribution's entry points on the first model it builds
    # (the job schemas, on the cold path); the worker uses none
    "PYDANTIC_DISABLE_PLUGINS": "__all__",
}


def configure_environment() -> None:
    """Defaults for the SDK's environment switches (an explicit setting wins). Call before the SDK is imported."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _cpu_info() -> dict:
    brand = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                brand = line.split(":", 1)[1].strip()
                break
    return {"brand_raw": brand}


def _cheap_cpuinfo():
    """A `cpuinfo` module whose get_cpu_info reads /proc/cpuinfo, present only while the SDK is imported."""
    if os.environ.get("REFLEX_REAL_CPUINFO") == "1":
        return contextlib.nullcontext()
    return stand_in("cpuinfo", get_cpu_info=_cpu_info)


# Packages of the SDK whose __init__ imports what the job loop never uses: the top-level package (the GraphQL API
# client, the endpoint client, credentials from ~/.runpod), runpod.cli (its SSH group: paramiko, invoke) and
# runpod.serverless.utils (S3 upload through boto3, downloads). Their submodules the loop needs import as usual.
DEFERRED_PACKAGES = ("runpod", "runpod.cli", "runpod.serverless.utils")


class _DeferredPackage(types.ModuleType):
    """A package whose __init__ runs on the first attribute it does not already have (its submodules and the
    attributes the import machinery sets are there without it), so `runpod.create_endpoint` or
    `runpod.serverless.utils.upload_file_to_bucket` still work, paying for their imports only then."""

    def __getattr__(self, name: str):
        # `from runpod import agent` asks for the attribute before it imports the submodule: a submodule is not
        # a reason to run the __init__
        submodule = importlib.machinery.PathFinder.find_spec(f"{self.__name__}.{name}", self.__path__)
        if self.__dict__.get("_init_ran") or submodule is not None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        self.__dict__["_init_ran"] = True
        self.__spec__.loader.exec_module(self)
        return getattr(self, name)


def _defer(name: str, search_path: list[str] | None) -> types.ModuleType | None:
    """Put a _DeferredPackage for `name` into sys.modules (found on `search_path`, its parent's folder, so that the
    parent need not be imported first); None where the SDK has no such package."""
    if name in sys.modules:
        return None
    spec = importlib.machinery.PathFinder.find_spec(name, search_path)
    if spec is None or spec.submodule_search_locations is None:
        return None
    module = _DeferredPackage(name)
    module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    module.__path__, module.__package__ = list(spec.submodule_search_locations), name
    sys.modules[name] = module
    return module


def import_job_loop() -> types.ModuleType:
    """`runpod` with `runpod.serverless` (the job loop) imported and DEFERRED_PACKAGES left for later.
    REFLEX_RUNPOD_DEFER=0 imports the SDK as shipped (for measuring)."""
    if os.environ.get("REFLEX_RUNPOD_DEFER") != "0" and "runpod" not in sys.modules:
        top = _defer("runpod", None)
        if top is not None:
            cli = _defer("runpod.cli", top.__path__)
            utils = _defer("runpod.serverless.utils", [os.path.join(top.__path__[0], "serverless")])
            import runpod.serverless

            for parent, child, module in ((top, "cli", cli), (runpod.serverless, "utils", utils)):
                if module is not None and child not in parent.__dict__:
                    setattr(parent, child, module)  # what importing it as a submodule would have bound
    import runpod.serverless

    return sys.modules["runpod"]


# The import thread's items for the worker (RunpodImport). FIRST_JOB: what a system1 job needs besides the job loop,
# built before the first job; LATER: the other job schemas, the OpenAI shapes and jinja2 (chat templates), which the
# queue worker leaves until its first result is posted (pydantic's first validator built pays its warm-up: the
# first job's parse does not).
FIRST_JOB = ("engine.worker.jobs:build_system1",)
LATER = ("engine.worker.jobs:build", "engine.worker.openai_api", "jinja2", "jinja2.sandbox")


class RunpodImport:
    """Imports for the worker, off the cold path: `import runpod.serverless` (unless `sdk` is False: the job loop on
    the standard library needs no SDK), then the `preload` items (needed before the first job), then — after
    `wait()` may already have returned — the `warm` ones (best effort, e.g. the other job schemas and jinja2 for the
    first chat job); with `warm_later` those wait for `warm_up()` (the queue worker calls it once its first result is
    posted). An item is a module to import or `module:function`, a function of it to call. With `background` False
    everything needed runs inside `wait()` instead. While the thread runs the needed part, the GIL's switch interval
    is short (engine/gil.py: the model loads on the main thread meanwhile).

    Phases: `runpod_import_ms` (the SDK import, 0 without it), `preload_ms`, and `runpod_import_wait_ms` (how long
    `wait()` blocked: the part left on the serial path).
    """

    def __init__(self, background: bool = True, preload: tuple[str, ...] = (), warm: tuple[str, ...] = (),
                 sdk: bool = True, warm_later: bool = False):  # fmt: skip
        self.background, self.sdk = background, sdk
        self.preload, self.warm, self.warm_later = preload, warm, warm_later
        self.module: types.ModuleType | None = None
        self.error: BaseException | None = None
        self.import_ms = self.preload_ms = self.wait_ms = 0.0
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False  # engine/gil.py: a short switch interval, released when the needed part ends
        if background:
            self._held = gil.hold()
            self._thread = threading.Thread(target=self._run, name="worker-imports", daemon=True)
            self._thread.start()

    def _needed(self) -> None:
        t0 = timing.now()
        try:
            if self.sdk:
                with _cheap_cpuinfo():
                    self.module = import_job_loop()
                self.import_ms = timing.ms_since(t0)
            t1 = timing.now()
            for item in self.preload:
                _load(item)
            self.preload_ms = timing.ms_since(t1)
        except BaseException as e:  # re-raised by wait(), on the main thread
            self.error = e
        finally:
            self._ready.set()

    def _run(self) -> None:
        try:
            self._needed()
        finally:
            if self._held:
                gil.release()
        if not self.warm_later:
            self._warm()

    def _warm(self) -> None:
        for item in self.warm:
            with contextlib.suppress(Exception):
                _load(item)

    def warm_up(self) -> None:
        """Start the `warm` items now, on a thread (`warm_later`: once; otherwise they follow the needed ones)."""
        if self.warm_later:
            self.warm_later = False
            self.settle()
            self._thread = threading.Thread(target=self._warm, name="worker-warm", daemon=True)
            self._thread.start()

    def wait(self) -> types.ModuleType | None:
        """The SDK (None without it), once it and the `preload` modules are imported."""
        t0 = timing.now()
        if not self.background:
            self._needed()
        self._ready.wait()
        self.wait_ms = timing.ms_since(t0)
        if self.error is not None:
            raise self.error
        return self.module

    def settle(self, timeout: float = 2.0) -> None:
        """Let the thread's imports finish (at most `timeout` s): called before each job, so that they do not take
        the GIL from the engine during its prompt eval."""
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def phases(self) -> dict[str, Any]:
        return {"runpod_import_ms": self.import_ms, "preload_ms": self.preload_ms,
                "runpod_import_wait_ms": self.wait_ms, "runpod_import_overlapped": self.background}  # fmt: skip


def _load(item: str) -> None:
    """Import `module`, or import `module:function` and call the function."""
    name, _, function = item.partition(":")
    module = importlib.import_module(name)
    if function:
        getattr(module, function)()


def for_runpod(outputs: Iterable[Any], config: dict) -> Iterator[Any]:
    """Pass outputs (and None ticks) through; an error becomes the SDK-proof form and, after a CUDA fault, recycles
    the worker."""
    for out in outputs:
        if isinstance(out, dict) and "error" in out:
            if out.get("refresh_worker"):
                config["refresh_worker"] = True
            yield {**out, "error": json.dumps({"error": out["error"], "error_kind": out["error_kind"]})}
            return
        yield out


def local_test_mode(argv: list[str], env: dict | os._Environ = os.environ) -> bool:
    """True where the SDK would run one test job (`--test_input` or test_input.json), as its worker.main decides."""
    if "--rp_serve_api" in argv or env.get("RUNPOD_REALTIME_PORT"):
        return False
    given = any(a == "--test_input" or a.startswith("--test_input=") for a in argv)
    return given or not env.get("RUNPOD_WEBHOOK_GET_JOB")


def stdlib_job_loop(argv: list[str], env: dict | os._Environ = os.environ) -> bool:
    """True where the worker takes its jobs through engine/worker/job_loop.py rather than the SDK: the platform's
    queue (RUNPOD_WEBHOOK_GET_JOB), none of the SDK's own modes or flags (`--test_input`, `--rp_serve_api`,
    `--rp_debugger`..., RUNPOD_REALTIME_PORT), the SDK's automatic fitness checks off (they are SDK code), and not
    REFLEX_JOB_LOOP=sdk."""
    if env.get("REFLEX_JOB_LOOP", "stdlib") == "sdk" or local_test_mode(argv, env) or env.get("RUNPOD_REALTIME_PORT"):
        return False
    checks_off = all(
        env.get(k, "").lower() == "true" for k in ("RUNPOD_SKIP_AUTO_SYSTEM_CHECKS", "RUNPOD_SKIP_GPU_CHECK")
    )
    return checks_off and not any(a.startswith(("--rp_", "--test_input")) for a in argv[1:])


def collecting(handler: Callable) -> Callable:
    """A non-generator form of an async generator handler: the outputs as a list (as /runsync aggregates them), or
    the error output itself, so the SDK's local test mode sees the error and exits 1."""

    async def run(job: dict) -> Any:
        outputs = [out async for out in handler(job)]
        if outputs and isinstance(outputs[-1], dict) and "error" in outputs[-1]:
            return outputs[-1]
        return outputs

    return run


def cancellable_dev_api(rp_fastapi: types.ModuleType) -> type:
    """The SDK's local API server (`--rp_serve_api`) plus `POST /cancel/{job_id}`, which the platform has and the
    dev server lacks: `/status/ID` and `/stream/ID` run their job in a task of its own, and a cancel cancels that
    task as the platform's stop channel does (the SDK's JobScaler cancels the job's task); the waiting request then
    answers `{"id", "status": "CANCELLED"}`."""
    import asyncio

    class CancellableAPI(rp_fastapi.WorkerAPI):
        def __init__(self, config: dict):
            super().__init__(config)
            self.running: dict[str, asyncio.Task] = {}
            self.cancelled: set[str] = set()
            self.rp_app.add_api_route("/cancel/{job_id}", self._sim_cancel, methods=["POST"])

        async def _sim_status(self, job_id: str):
            return await self._cancellable(job_id, super()._sim_status)

        async def _sim_stream(self, job_id: str):
            return await self._cancellable(job_id, super()._sim_stream)

        async def _cancellable(self, job_id: str, route: Callable):
            task = asyncio.ensure_future(route(job_id))
            self.running[job_id] = task
            try:
                return await task
            except asyncio.CancelledError:
                if job_id not in self.cancelled:  # this request itself was cancelled (shutdown): not ours to hide
                    raise
                rp_fastapi.job_list.remove(job_id)
                return {"id": job_id, "status": "CANCELLED"}
            finally:
                self.running.pop(job_id, None)
                self.cancelled.discard(job_id)

        async def _sim_cancel(self, job_id: str):
            task = self.running.get(job_id)
            if task is not None:
                self.cancelled.add(job_id)
                task.cancel()
            elif rp_fastapi.job_list.get(job_id) is not None:  # queued by /run, not started: just drop it
                rp_fastapi.job_list.remove(job_id)
            else:
                return {"id": job_id, "status": "FAILED", "error": "Job ID not found"}
            return {"id": job_id, "status": "CANCELLED"}

    return CancellableAPI


def start(runpod: types.ModuleType, config: dict, worker) -> None:
    """Register the engine's fitness check and hand over to the SDK (blocks for the worker's lifetime)."""
    runpod.serverless.register_fitness_check(worker.check_ready)
    if local_test_mode(sys.argv):
        config = {**config, "handler": collecting(config["handler"])}
    if "--rp_serve_api" in sys.argv:
        from runpod.serverless.modules import rp_fastapi

        rp_fastapi.WorkerAPI = cancellable_dev_api(rp_fastapi)  # the SDK builds its server from this name
    runpod.serverless.start(config)
