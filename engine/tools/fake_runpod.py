"""A stand-in for Runpod's job queue on loopback, for tests and cold-start measurements: one worker's job-take,
job-stop, job-done, job-stream and ping endpoints, recording every request it gets.

    with FakeRunpod(jobs=[{"id": "a", "input": {...}}]) as platform:
        env = platform.worker_env()          # the webhook variables the platform gives a worker
        ...                                  # start a worker with env
        platform.wait_for(lambda: "a" in platform.results)

The URL shapes follow the platform's variables: `$ID` in RUNPOD_WEBHOOK_GET_JOB is the worker, in the two POST URLs
the job; `$RUNPOD_POD_ID` is the worker.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.parse
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    t: float  # time.monotonic() on arrival
    method: str
    kind: str  # take | take-batch | stop | done | stream | ping | other
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


_KINDS = {"job-take": "take", "job-take-batch": "take-batch", "job-stop": "stop", "job-done": "done",
          "job-stream": "stream", "ping": "ping"}  # fmt: skip


class FakeRunpod:
    """Jobs are handed out in order, one per take; `take_answers` are statuses answered to the first takes instead
    (204, 400, 429, 500...), `post_answers` to the first result or stream posts (which are then not kept). A take
    with no job waits `poll_s` for one, then answers 204; a stop poll waits `stop_poll_s` for `stop()`ped ids, then
    answers 204."""

    def __init__(self, jobs: Iterable[dict] = (), take_answers: Iterable[int] = (), post_answers: Iterable[int] = (),
                 poll_s: float = 0.2, stop_poll_s: float = 0.5):  # fmt: skip
        self.jobs: deque[dict] = deque(jobs)
        self.take_answers: deque[int] = deque(take_answers)
        self.post_answers: deque[int] = deque(post_answers)
        self.poll_s, self.stop_poll_s = poll_s, stop_poll_s
        self.to_stop: list[str] = []
        self.requests: list[Request] = []
        self.results: dict[str, Any] = {}  # job id -> the posted result
        self.streams: dict[str, list[Any]] = defaultdict(list)  # job id -> the posted stream outputs, in order
        self.cond = threading.Condition()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def worker_env(self, pod_id: str = "worker1", api_key: str = "test-key", ping_interval_ms: int = 1000) -> dict:
        base = f"{self.base}/v2/test-endpoint"
        return {"RUNPOD_POD_ID": pod_id, "RUNPOD_AI_API_KEY": api_key, "RUNPOD_PING_INTERVAL": str(ping_interval_ms),
                "RUNPOD_WEBHOOK_GET_JOB": f"{base}/job-take/$ID?gpu=test",
                "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base}/job-done/$RUNPOD_POD_ID/$ID?gpu=test",
                "RUNPOD_WEBHOOK_POST_STREAM": f"{base}/job-stream/$RUNPOD_POD_ID/$ID?gpu=test",
                "RUNPOD_WEBHOOK_PING": f"{base}/ping/$RUNPOD_POD_ID?gpu=test"}  # fmt: skip

    def push(self, job: dict) -> None:
        with self.cond:
            self.jobs.append(job)
            self.cond.notify_all()

    def stop(self, job_id: str) -> None:
        """What a /cancel or an execution timeout does: the id goes out on the worker's stop channel."""
        with self.cond:
            self.to_stop.append(job_id)
            self.cond.notify_all()

    def of_kind(self, kind: str) -> list[Request]:
        with self.cond:
            return [r for r in self.requests if r.kind == kind]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 60.0,
                 alive: Callable[[], bool] | None = None) -> None:  # fmt: skip
        """Until `predicate()` (checked on every request), or raise TimeoutError; so does `alive()` turning false."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                if time.monotonic() > deadline or (alive is not None and not alive()):
                    raise TimeoutError("the fake platform did not see what was waited for")
                self.cond.wait(0.05)

    def __enter__(self) -> FakeRunpod:
        threading.Thread(target=self.server.serve_forever, name="fake-runpod", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- the endpoints (on the server's threads) -------------------------------------------------------------

    def answer(self, req: Request) -> tuple[int, Any]:
        if req.kind == "take":
            return self._take()
        if req.kind == "stop":
            with self.cond:
                self.cond.wait_for(lambda: self.to_stop, self.stop_poll_s)
                ids, self.to_stop[:] = list(self.to_stop), []
            return (200, {"jobsToStop": ids}) if ids else (204, None)
        if req.kind in ("done", "stream"):
            job_id = req.path.rsplit("/", 1)[-1]
            with self.cond:
                if self.post_answers:
                    return self.post_answers.popleft(), {}
                if req.kind == "done":
                    self.results[job_id] = req.json()
                else:
                    self.streams[job_id].append(req.json())
                self.cond.notify_all()
        return (200, {}) if req.kind != "other" else (404, {})

    def _take(self) -> tuple[int, Any]:
        with self.cond:
            if self.take_answers:
                return self.take_answers.popleft(), None
            self.cond.wait_for(lambda: self.jobs, self.poll_s)
            return (200, self.jobs.popleft()) if self.jobs else (204, None)


def _handler_class(platform: FakeRunpod) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the platform's front end
        wbufsize = 1 << 16  # one send per answer (headers and body apart wait out Nagle against a delayed ACK)

        def log_message(self, *args):
            pass

        def _serve(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            parts = url.path.split("/")
            kind = next((_KINDS[p] for p in parts if p in _KINDS), "other")
            req = Request(time.monotonic(), self.command, kind, url.path, urllib.parse.parse_qs(url.query),
                          dict(self.headers.items()), body)  # fmt: skip
            with platform.cond:
                platform.requests.append(req)
                platform.cond.notify_all()
            status, payload = platform.answer(req)
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            if payload is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the worker went away mid-poll
                self.wfile.write(data)
                self.wfile.flush()

        do_GET = do_POST = _serve

    return Handler
