"""The worker in queue mode, as on Runpod: `python handler.py` with the platform's webhook variables pointed at a
stand-in of the job-take, job-stop, job-done and ping endpoints on loopback. The SDK's own job loop (JobScaler) takes
a long job, the stop channel cancels it (what /cancel and execution timeouts do), and the next job is answered as
a fresh worker would answer it; heartbeats keep going meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from tests.worker_support import ROOT, TINY, WORKER_ENV

LONG = {"prompt": "Hello", "max_tokens": 4000, "temperature": 0.0}  # 3 s or more on the tiny model
SHORT = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}


class Platform(BaseHTTPRequestHandler):
    queue: ClassVar[list[dict]] = []
    stop: ClassVar[list[str]] = []
    events: ClassVar[list[tuple[float, str, str]]] = []  # (time, what, job id)
    results: ClassVar[dict[str, dict]] = {}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: dict | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = urllib.parse.urlparse(self.path).path
        if path.startswith("/v2/job-take/"):
            with self.lock:
                job = self.queue.pop(0) if self.queue else None
            if job is None:
                time.sleep(0.2)  # a short long-poll
                return self._send(204)
            self.events.append((time.monotonic(), "taken", job["id"]))
            return self._send(200, job)
        if path.startswith("/v2/job-stop/"):
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                with self.lock:
                    ids, self.stop[:] = list(self.stop), []
                if ids:
                    self.events.append((time.monotonic(), "stop sent", ids[0]))
                    return self._send(200, {"jobsToStop": ids})
                time.sleep(0.01)
            return self._send(204)
        if path.startswith("/ping/"):  # the heartbeat names the job in progress, if any
            job_id = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).get("job_id", [""])[0]
            self.events.append((time.monotonic(), "ping", job_id))
            return self._send(200, {})
        return self._send(404, {})

    def do_POST(self):
        parsed = urllib.parse.urlparse(self.path)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        job_id = parsed.path.rsplit("/", 1)[-1]
        if parsed.path.startswith("/v2/job-done/"):
            self.events.append((time.monotonic(), "done", job_id))
            self.results[job_id] = body
        return self._send(200, {})


def test_the_stop_channel_cancels_a_running_job_and_the_next_job_is_answered():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Platform)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    Platform.queue[:] = [{"id": "job-long", "input": LONG}]
    env = {**os.environ, **WORKER_ENV, "MODEL_PATH": TINY, "MAX_NEW_TOKENS": "4000", "MAX_SEQ_LEN": "4096",
           "RUNPOD_POD_ID": "worker1", "RUNPOD_AI_API_KEY": "test", "RUNPOD_PING_INTERVAL": "1000",
           "RUNPOD_WEBHOOK_GET_JOB": f"{base}/v2/job-take/$ID?gpu=test",
           "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base}/v2/job-done/$RUNPOD_POD_ID/$ID?gpu=test",
           "RUNPOD_WEBHOOK_POST_STREAM": f"{base}/v2/job-stream/$RUNPOD_POD_ID/$ID?gpu=test",
           "RUNPOD_WEBHOOK_PING": f"{base}/ping/$RUNPOD_POD_ID?gpu=test"}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-u", "handler.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any(e[1] == "taken" for e in Platform.events):
            assert proc.poll() is None and time.monotonic() < deadline, "the worker took no job"
            time.sleep(0.05)
        # Stop once a heartbeat reports the long job in progress (the SDK then tracks it: a stop that came before
        # would find no job to stop), not after a fixed delay; the job runs for seconds more.
        while not any(what == "ping" and job == "job-long" for _, what, job in Platform.events):
            assert proc.poll() is None and time.monotonic() < deadline, "no heartbeat during the long job"
            time.sleep(0.01)
        time.sleep(0.3)  # the job's task is created within the SDK's 0.1 s scheduling tick after it is queued
        with Platform.lock:
            Platform.queue.append({"id": "job-short", "input": SHORT})
            Platform.stop.append("job-long")
        while "job-short" not in Platform.results:
            assert proc.poll() is None and time.monotonic() < deadline, "the next job was not answered"
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(20)
        server.shutdown()
    at = {(what, job): t for t, what, job in Platform.events}
    delay = at[("taken", "job-short")] - at[("stop sent", "job-long")]
    print(json.dumps({"stop_to_next_job_taken_ms": round(1000 * delay, 1)}))
    assert "job-long" not in Platform.results  # stopped, never completed
    assert delay < 1.5, delay  # the long job had seconds left; the SDK's own loop polls every 0.1-0.2 s
    pings = [t for t, what, _ in Platform.events if what == "ping"]
    assert any(at[("taken", "job-long")] < t < at[("stop sent", "job-long")] for t in pings)  # heartbeats went on
    from engine.engine import Engine

    fresh = Engine.load(TINY, max_seq_len=2048).generate(SHORT["prompt"], max_tokens=8)
    (answer,) = Platform.results["job-short"]["output"]
    assert answer["text"] == fresh["text"] and answer["token_ids"] == fresh["token_ids"]
