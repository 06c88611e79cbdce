"""The Runpod queue worker's job loop on the standard library. It talks to the platform the way the job loop of
runpod-python 1.12.0 (runpod_wire.SDK_VERSION) does, so a queue worker never imports the SDK, whose aiohttp stack
takes longer to import (~0.9 s on an H200 host) than the engine takes to load. tests/test_job_loop.py runs both loops
against one fake platform and compares the requests they send. What it mirrors, by SDK module:

- worker.py, rp_fitness.py: the registered fitness checks run first. A failing one is reported on the ping URL
  (`status=unhealthy`, `check`, `reason`) and the process ends with os._exit(1). The SDK's automatic GPU and system
  checks are not here; the handler keeps the SDK's loop when either one is switched on.
- rp_job.get_job: GET RUNPOD_WEBHOOK_GET_JOB (`$ID`: RUNPOD_POD_ID, else a random uuid) + `&job_in_progress=0|1`
  (runpod_wire.jobs_in reads the answer). One job at a time (JobScaler's concurrency of 1): there is no take while
  a job runs. A 429 waits 5 s; any other failure is logged and the take is sent again.
- rp_job.handle_job, run_job_generator, rp_http: each output of the async generator handler is POSTed as
  `{"output": out}` to RUNPOD_WEBHOOK_POST_STREAM (`$RUNPOD_POD_ID`, then `$ID`: the job) + `&isStream=false`.
  Then the result goes to RUNPOD_WEBHOOK_POST_OUTPUT + `&isStream=true`: `{"output": [the outputs]}` with
  config["return_aggregate_stream"], else `{"output": []}`. An output dict with a truthy `error` ends the job as
  `{"error": str(error)}` (that output is not streamed), and an exception as `{"error": "handler: ... \\ntraceback:
  ..."}`. With config["refresh_worker"] set, the result gets `"stopPod": true` and the worker exits after the job.
  Bodies are JSON with non-ASCII kept, sent with runpod_wire.POST_HEADERS. A 5xx is tried twice more, after 2 s and
  3 s. `X-Request-ID` names the job last posted for, and later requests carry it too (the SDK sets it on its shared
  session).
- rp_job.get_stop_signals, JobScaler.monitor_stop_signals: a long-poll of the job-take URL with `/job-stop/` in
  place of `/job-take/`. `{"jobsToStop": [ids]}` cancels those jobs' tasks, and no result is posted for them (this
  is how a /cancel or an execution timeout reaches a worker). It waits 1 s after an empty answer or an error, and
  5 s after a 429.
- rp_ping.Heartbeat: GET RUNPOD_WEBHOOK_PING (`$RUNPOD_POD_ID`) + `job_id` (the jobs in progress, comma-joined,
  left out when idle) and `runpod_version`, every RUNPOD_PING_INTERVAL ms // 1000 s (at least 1 s here), with a
  timeout of twice that. It is tried 3 more times after a connection error, a 429 or a 5xx (after 0, 2 and 4 s),
  and sent only when RUNPOD_AI_API_KEY and RUNPOD_POD_ID are set. Here it is a thread where the SDK forks a
  process: the engine computes outside the GIL, one step at a time, so the thread is not starved.
- JobScaler.start: SIGTERM and SIGINT stop the taking. A job already taken finishes and posts its result first.

Not the SDK's: `after_first_job` is called once the first job's result is posted, for start-up work that the first
job did not need (handler.py: the other job schemas, jinja2), done while the worker is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from engine.worker import runpod_wire as wire

POST_RETRY_WAITS_S = (2.0, 3.0)  # aiohttp_retry's FibonacciRetry(attempts=3), on a 5xx only
PING_RETRY_WAITS_S = (0.0, 2.0, 4.0)  # urllib3's Retry(total=3, backoff_factor=1)
PING_RETRY_STATUSES = (429, 500, 502, 503, 504)
# the SDK's log level names (RUNPOD_LOG_LEVEL); NOTSET silences the log
LOG_LEVELS = {"NOTSET": logging.CRITICAL + 1, "TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
              "WARN": logging.WARNING, "ERROR": logging.ERROR}  # fmt: skip

log = logging.getLogger(__name__)


class JobLoop:
    """Takes jobs and answers them with `handler`, an async generator function of the job, until
    config["refresh_worker"] is set after a job or `stop()` is called (SIGTERM, SIGINT). `after_first_job` (quick:
    it runs on the loop) is called once the first job's result is posted."""

    def __init__(self, handler: Callable, config: dict, env: Mapping[str, str] = os.environ,
                 fitness_checks: Iterable[Callable] = (),
                 after_first_job: Callable[[], None] | None = None):  # fmt: skip
        if not inspect.isasyncgenfunction(handler):
            raise TypeError("the job loop runs async generator handlers only")
        self.handler, self.config, self.env = handler, config, env
        self.fitness_checks = list(fitness_checks)
        self.after_first_job = after_first_job
        worker = env.get("RUNPOD_POD_ID") or str(uuid.uuid4())
        self.take_url = str(env.get("RUNPOD_WEBHOOK_GET_JOB")).replace("$ID", worker)
        self.stop_url = self.take_url.replace("/job-take/", "/job-stop/") if "/job-take/" in self.take_url else None
        self.done_url = env.get("RUNPOD_WEBHOOK_POST_OUTPUT", "JOB_DONE_URL").replace("$RUNPOD_POD_ID", worker)
        self.stream_url = env.get("RUNPOD_WEBHOOK_POST_STREAM", "JOB_STREAM_URL").replace("$RUNPOD_POD_ID", worker)
        self.ping_url = env.get("RUNPOD_WEBHOOK_PING", "PING_NOT_SET").replace("$RUNPOD_POD_ID", worker)
        self.ping_interval_s = max(1, int(env.get("RUNPOD_PING_INTERVAL", 10000)) // 1000)
        self.headers = wire.session_headers(env)  # shared with the stop channel, as the SDK's one session
        self.http = wire.Http(self.headers)  # takes and results, one after the other
        self.tasks: dict[str, asyncio.Task | None] = {}  # jobs taken and not answered yet (on the loop's thread)
        self.job_ids: str | None = None  # their ids, comma-joined, for the heartbeat's thread
        self.stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> None:
        """Fitness checks, the heartbeat, then jobs; blocks until the loop ends."""
        self._check_fitness()
        if self.env.get("RUNPOD_AI_API_KEY") and self.env.get("RUNPOD_POD_ID") and self.ping_url != "PING_NOT_SET":
            threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        asyncio.run(self._serve())

    def stop(self) -> None:
        """No more takes. A job in flight (and any taken with it) is answered first."""
        self.stopping.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread (tests): no signals
                self._loop.add_signal_handler(sig, self.stop)
        if self.stop_url is None:
            log.warning("no /job-take/ in the job-take URL: no stop channel, so a cancel cannot stop a running job")
        else:
            threading.Thread(target=self._watch_stops, name="job-stop", daemon=True).start()
        while not self.stopping.is_set():
            jobs = await asyncio.to_thread(self._take)
            self._track({job["id"]: None for job in jobs})
            for job in jobs:
                await self._run(job)
                if self.after_first_job is not None:
                    start, self.after_first_job = self.after_first_job, None
                    start()
                if self.config.get("refresh_worker"):
                    log.info("refresh_worker set: the worker exits after this job", extra={"job_id": job["id"]})
                    self.stop()

    def _track(self, changes: dict[str, asyncio.Task | None], done: str | None = None) -> None:
        self.tasks.update(changes)
        self.tasks.pop(done, None)
        self.job_ids = ",".join(self.tasks) or None

    def _take(self) -> list[dict]:
        try:
            return wire.jobs_in(*self.http.request("GET", f"{self.take_url}&job_in_progress={int(bool(self.tasks))}"))
        except wire.TooManyRequests:
            time.sleep(5)
        except TimeoutError:
            log.debug("job take timed out; taking again")
        except Exception as e:
            log.error("Failed to get job. | Error Type: %s | Error Message: %s", type(e).__name__, e)
        return []

    async def _run(self, job: dict) -> None:
        task = asyncio.ensure_future(self._answer(job))
        self._track({job["id"]: task})
        try:
            await asyncio.wait([task])
        finally:
            self._track({}, done=job["id"])
        if task.cancelled():
            log.info("Job stopped.", extra={"job_id": job["id"]})
        elif task.exception() is not None:
            log.error("Error handling job: %s", task.exception(), extra={"job_id": job["id"]})

    def _stop_job(self, job_id: str) -> None:
        task = self.tasks.get(job_id)
        if task is not None:
            log.info("Stopping job.", extra={"job_id": job_id})
            task.cancel()

    async def _answer(self, job: dict) -> None:
        outputs: list[Any] = []
        result: dict[str, Any] = {"output": outputs}
        try:
            async with contextlib.aclosing(self.handler(job)) as stream:
                async for out in stream:
                    if isinstance(out, dict) and out.get("error"):
                        result = {"error": str(out["error"])}
                        break
                    if self.config.get("return_aggregate_stream"):
                        outputs.append(out)
                    await asyncio.to_thread(self._post, self.stream_url, {"output": out}, job["id"], False)
        except Exception as e:
            log.exception("handler error", extra={"job_id": job["id"]})
            result = {"error": f"handler: {e} \ntraceback: {traceback.format_exc()}"}
        if self.config.get("refresh_worker"):
            result["stopPod"] = True
        await asyncio.to_thread(self._post, self.done_url, result, job["id"], True)
        log.info("Finished.", extra={"job_id": job["id"]})

    def _post(self, template: str, data: Any, job_id: str, is_stream: bool) -> None:
        self.headers["X-Request-ID"] = job_id
        try:
            body = json.dumps(data, ensure_ascii=False).encode()
        except (TypeError, ValueError) as e:
            log.error("Error while returning job result. | %s", e, extra={"job_id": job_id})
            return
        url = template.replace("$ID", job_id) + f"&isStream={'true' if is_stream else 'false'}"
        for wait in (*POST_RETRY_WAITS_S, None):
            try:
                status = self.http.request("POST", url, body, wire.POST_HEADERS, wire.POST_TIMEOUT_S)[0]
            except Exception as e:  # a connection error, a bad URL or header: logged, as the SDK logs it
                log.error("Failed to return job results. | %s", e, extra={"job_id": job_id})
                return
            if status < 500 or wait is None:
                break
            time.sleep(wait)
        if status >= 400:
            log.error("Failed to return job results. | status %d", status, extra={"job_id": job_id})

    def _watch_stops(self) -> None:
        client = wire.Http(self.headers)  # a connection of its own: the poll stays open while results are posted
        while not self.stopping.is_set():
            try:
                ids = wire.stops_in(*client.request("GET", self.stop_url))
            except wire.TooManyRequests:
                time.sleep(5)
                continue
            except TimeoutError:
                continue
            except Exception as e:
                log.error("stop channel: %s: %s", type(e).__name__, e)
                time.sleep(1)
                continue
            for job_id in ids:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nothing is left to stop
                    self._loop.call_soon_threadsafe(self._stop_job, job_id)
            if not ids:
                time.sleep(1)

    def _heartbeat(self) -> None:
        client = wire.Http({"Authorization": self.env["RUNPOD_AI_API_KEY"], "User-Agent": self.headers["User-Agent"],
                            "Accept-Encoding": "gzip, deflate", "Accept": "*/*"})  # fmt: skip
        while True:
            for wait in (*PING_RETRY_WAITS_S, None):
                params = {"job_id": self.job_ids, "runpod_version": wire.SDK_VERSION}
                try:
                    status = client.request("GET", wire.with_params(self.ping_url, params), None, None,
                                            2.0 * self.ping_interval_s)[0]  # fmt: skip
                    if status not in PING_RETRY_STATUSES:
                        break
                    error: object = f"status {status}"
                except Exception as e:  # the heartbeat never stops
                    error = e
                if wait is None:
                    log.error("Ping Request Error: %s", error)
                else:
                    time.sleep(wait)
            time.sleep(self.ping_interval_s)

    def _check_fitness(self) -> None:
        for check in self.fitness_checks:
            try:
                if inspect.iscoroutinefunction(check):
                    asyncio.run(check())
                else:
                    check()
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                log.error("Fitness check failed: %s | %s", check.__name__, reason)
                key = self.env.get("RUNPOD_AI_API_KEY")
                if key and self.env.get("RUNPOD_WEBHOOK_PING", "PING_NOT_SET") != "PING_NOT_SET":
                    params = {"status": "unhealthy", "check": check.__name__, "reason": reason[:256],
                              "runpod_version": wire.SDK_VERSION}  # fmt: skip
                    with contextlib.suppress(Exception):  # best effort: the exit is what counts
                        wire.Http({"Authorization": key}).request("GET", wire.with_params(self.ping_url, params),
                                                                   timeout=2.0)  # fmt: skip
                log.error("Worker is unhealthy, exiting.")
                logging.shutdown()
                os._exit(1)


class SdkLogFormat(logging.Formatter):
    """The SDK logger's lines: JSON `{"requestId", "message", "level"}` on the platform (RUNPOD_ENDPOINT_ID set),
    else `LEVEL  | job id | message`."""

    def __init__(self, on_platform: bool):
        super().__init__()
        self.on_platform = on_platform

    def format(self, record: logging.LogRecord) -> str:
        level = "WARN" if record.levelname == "WARNING" else record.levelname
        message, job_id = record.getMessage(), getattr(record, "job_id", None)
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if self.on_platform:
            return json.dumps({"requestId": job_id, "message": message, "level": level})
        return f"{level.ljust(7)}| {f'{job_id} | ' if job_id else ''}{message}"


def serve(config: dict, fitness_checks: Iterable[Callable] = (), env: Mapping[str, str] = os.environ,
          after_first_job: Callable[[], None] | None = None) -> None:  # fmt: skip
    """The worker's entry point: this module logs to stdout in the SDK's format at RUNPOD_LOG_LEVEL; then the loop."""
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(SdkLogFormat(bool(env.get("RUNPOD_ENDPOINT_ID"))))
    log.addHandler(out)
    log.propagate = False
    log.setLevel(
        LOG_LEVELS.get(env.get("RUNPOD_LOG_LEVEL", env.get("RUNPOD_DEBUG_LEVEL", "INFO")).upper(), logging.INFO)
    )
    log.info("Starting the job loop (the Runpod protocol of runpod %s, on the standard library)", wire.SDK_VERSION)
    JobLoop(config["handler"], config, env, fitness_checks, after_first_job).run()
