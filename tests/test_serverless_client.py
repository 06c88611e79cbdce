"""serverless/client.py and serverless/bench_endpoint.py against a stand-in of Runpod's queue API on loopback,
backed by the real handler (in process)."""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from engine.worker.aio import collect
from tests.worker_support import ROOT, handler_module

sys.path.insert(0, os.path.join(ROOT, "serverless"))
import bench_endpoint
import client

_ids = itertools.count()


class FakeRunpod(BaseHTTPRequestHandler):
    """POST /v2/EP/run|runsync, GET /v2/EP/status/ID|stream/ID|health, shaped like the platform's answers."""

    jobs: ClassVar[dict] = {}

    def log_message(self, *args):  # keep the test output clean
        pass

    def _send(self, body: dict, code: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _finish(self, job_id: str) -> dict:
        job = self.jobs[job_id]
        if "outputs" not in job:
            job["outputs"] = collect(handler_module().handler, {"id": job_id, "input": job["input"]})
        outputs = job["outputs"]
        if outputs and isinstance(outputs[-1], dict) and "error" in outputs[-1]:
            return {"id": job_id, "status": "FAILED", "error": outputs[-1]["error"], "delayTime": 5}
        return {"id": job_id, "status": "COMPLETED", "output": outputs, "delayTime": 5, "executionTime": 7}

    def _openai(self, route: str, body: dict) -> None:
        """POST /v2/EP/openai/v1/...: the platform runs {"openai_route", "openai_input"} as a job and relays it."""
        outputs = collect(
            handler_module().handler, {"id": "oa", "input": {"openai_route": route, "openai_input": body}}
        )
        if body.get("stream"):
            data = "".join(outputs).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
        else:
            data = json.dumps(outputs[-1]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        assert self.headers["Authorization"] == "Bearer test-key"
        parts = urllib.parse.urlparse(self.path).path.split("/")
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        if parts[3] == "openai":  # /v2/EP/openai/v1/chat/completions
            return self._openai("/" + "/".join(parts[4:]), body)
        path = parts[3]
        if path == "cancel":
            self.jobs[parts[4]]["cancelled"] = True
            return self._send({"id": parts[4], "status": "CANCELLED"})
        job_id = f"job-{next(_ids)}"
        self.jobs[job_id] = {"input": body["input"]}
        self._send(self._finish(job_id) if path == "runsync" else {"id": job_id, "status": "IN_QUEUE"})

    def do_GET(self):
        parts = urllib.parse.urlparse(self.path).path.split("/")[3:]
        if parts == ["health"]:
            return self._send({"jobs": {"completed": 1}, "workers": {"idle": 0, "running": 0}})
        done = self._finish(parts[1])
        if parts[0] == "stream":
            fresh = not self.jobs[parts[1]].get("streamed")
            self.jobs[parts[1]]["streamed"] = True
            items = [{"output": o} for o in done.get("output", [])] if fresh else []
            return self._send({"status": done["status"], "stream": items})
        return self._send(done)


@pytest.fixture(scope="module")
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRunpod)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v2"
    server.shutdown()


@pytest.fixture(autouse=True)
def _env(api, monkeypatch):
    monkeypatch.setattr(client, "API", api)
    monkeypatch.setenv("RUNPOD_API_KEY", "test-key")


def test_runsync_system1_and_failure(capsys):
    assert client.main(["runsync", "EP", "--prompt", "The capital of France is", "--candidate", " Paris"]) == 0
    out, err = capsys.readouterr()
    (result,) = json.loads(out)
    assert result["best_text"] == " Paris" and json.loads(err)["delayTime"] == 5
    assert client.main(["runsync", "EP", "--input", json.dumps({"prompt": "x", "max_tokens": "no"})]) == 1
    failed = json.loads(capsys.readouterr().out)
    assert failed["status"] == "FAILED" and failed["error"]["error_kind"] == "invalid_input"


def test_run_status_and_stream(capsys):
    assert client.main(["run", "EP", "--prompt", "Hello", "--max-tokens", "4"]) == 0
    job = json.loads(capsys.readouterr().out)
    assert client.main(["status", "EP", job["id"]]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["usage"]["completion_tokens"] >= 1
    assert client.main(["stream", "EP", "--prompt", "Hello", "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(err[err.index("{") :])
    assert out.strip() and summary["finish_reason"] in ("stop", "length")
    assert client.main(["health", "EP"]) == 0
    capsys.readouterr()
    assert client.main(["cancel", "EP", job["id"]]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "CANCELLED"


def test_chat_through_the_openai_package(capsys):
    assert client.main(["chat", "EP", "--prompt", "Hi", "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(err)["usage"]["completion_tokens"] >= 1
    assert client.main(["chat", "EP", "--prompt", "Hi", "--max-tokens", "4", "--stream"]) == 0
    streamed, _ = capsys.readouterr()
    assert streamed == out  # greedy: the same text, streamed


def test_bench_endpoint_summarizes_cold_and_warm(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_endpoint.main(["EP", "--cold", "1", "--warm", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [s["kind"] for s in data["samples"]] == ["cold", "warm", "warm"]
    assert data["summary"]["warm"]["n"] == 2 and data["summary"]["cold_round"]["client_ms"]["p50"] > 0
    assert bench_endpoint.percentile([1.0, 2.0, 3.0, 4.0], 95) == 4.0
    assert bench_endpoint.percentile([5.0], 50) == 5.0
