"""Runpod serverless worker: the engine is loaded once, at import (once per cold worker); `handler(job)`, an async
generator, runs each job a step at a time on the engine thread (engine/worker/aio.py), so cancels and timeouts land
within one decode step.

In the platform's queue (RUNPOD_WEBHOOK_GET_JOB set) the jobs come through engine/worker/job_loop.py, which speaks
the SDK's protocol on the standard library; REFLEX_JOB_LOOP=sdk keeps the SDK's own loop.

Local modes, through the SDK (no GPU needed; the CPU backend answers):
    python handler.py                                  # runs ./test_input.json
    python handler.py --test_input '{"input": {...}}'  # runs that job
    python handler.py --rp_serve_api --rp_api_port 8000 --rp_api_host 127.0.0.1   # POST /runsync, /run, /stream,
                                                                                   # /status, /cancel
    PORT=8000 python handler.py          # load-balancing endpoint mode: /ping, /v1/..., /system1, /generate
Job schemas, env settings and deployment: serverless/README.md.
"""

import os
import sys

from engine import timing  # first: the cold-start clock
from engine.cuda import prestart, upload_early


def _local_model() -> str | None:
    from engine.worker.models import local_path  # on the upload's thread: its imports cost this one little

    return local_path()


prestart()  # the CUDA context is created on a thread while the rest imports and the model opens, as the CLI does
upload_early(_local_model)  # and, on a thread beside it, the weights of a model already on this machine

from engine.worker import serverless  # noqa: E402  (then the SDK import thread, which needs nothing else)

serverless.configure_environment()
# A load-balancing endpoint (PORT, and no job queue to take from): its own HTTP server, no SDK.
if __name__ == "__main__" and os.environ.get("PORT") and not os.environ.get("RUNPOD_WEBHOOK_GET_JOB"):
    from engine.worker import http
    from engine.worker.service import Worker

    timing.mark_imports_done()
    http.serve(Worker.load)  # /ping answers 204 while the model loads on a thread (engine/worker/http.py)
    raise SystemExit(0)

# The platform's job queue: our job loop on the standard library (engine/worker/job_loop.py), no SDK import at all;
# the SDK's loop for its local modes (--test_input, test_input.json, --rp_serve_api) and with REFLEX_JOB_LOOP=sdk.
stdlib_loop = __name__ == "__main__" and serverless.stdlib_job_loop(sys.argv)
_imports = serverless.RunpodImport(
    background=os.environ.get("REFLEX_RUNPOD_IMPORT") != "serial",
    # the job loop and the system1 job's schema (pydantic) before the first job; the other schemas and jinja2 after
    # it (queue mode: once its result is posted, while the worker is idle)
    preload=(("engine.worker.job_loop",) if stdlib_loop else ()) + serverless.FIRST_JOB,
    warm=serverless.LATER,
    warm_later=stdlib_loop,
    sdk=not stdlib_loop,
)

from engine.worker.aio import EngineThread  # noqa: E402 - after the background imports have started
from engine.worker.service import Worker  # noqa: E402

timing.mark_imports_done()
worker = Worker.load()
engine_thread = EngineThread()
runpod = _imports.wait()
worker.boot.update(_imports.phases(), job_loop="stdlib" if stdlib_loop else "sdk",
                   process_start_to_worker_ready_ms=timing.since_process_start_ms())  # fmt: skip

config = {"return_aggregate_stream": True}


async def handler(job):
    """Yields the job's outputs (one result, or stream batches then the result); errors as the last output."""
    _imports.settle()  # the warm imports end before the engine's first step instead of competing with it
    job_input = job.get("input") if isinstance(job, dict) else None
    async for out in engine_thread.drive(serverless.for_runpod(worker.run(job_input), config)):
        yield out


config["handler"] = handler

if __name__ == "__main__" and stdlib_loop:
    from engine.worker import job_loop

    job_loop.serve(config, fitness_checks=[worker.check_ready], after_first_job=_imports.warm_up)
elif __name__ == "__main__":
    serverless.start(runpod, config, worker)
