"""Shared helpers for the worker tests: the handler module on the tiny model, the local API server, job results."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from engine.errors import ERROR_KINDS
from engine.worker.aio import collect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "fixtures", "qwen3-tiny-q8_0.gguf")
# The worker environment of the tests: the tiny model and small limits, so that fuzzing and soaking stay fast.
WORKER_ENV = {
    "MODEL_PATH": TINY,
    "MAX_SEQ_LEN": "256",
    "MAX_NEW_TOKENS": "16",
    "MAX_CANDIDATES": "8",
    "MAX_PROMPT_CHARS": "4000",
    "RUNPOD_LOG_LEVEL": "WARN",
}


def handler_module():
    """`import handler` under WORKER_ENV (read at import only; the environment is put back afterwards)."""
    if "handler" in sys.modules:
        return sys.modules["handler"]
    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)
    try:
        return importlib.import_module("handler")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_job(handler, job_input) -> list:
    """Every output of the async generator handler for one job."""
    return collect(handler, {"id": "test", "input": job_input})


def typed_error(output) -> dict | None:
    """The `{"error", "error_kind"}` carried by a handler output, or None when it is no error (see engine.serverless:
    the handler sends the error as a JSON string so that its kind survives the SDK)."""
    if not (isinstance(output, dict) and "error" in output):
        return None
    err = json.loads(output["error"])
    assert set(err) == {"error", "error_kind"}, err
    assert err["error_kind"] in ERROR_KINDS and err["error_kind"] == output["error_kind"], err
    if isinstance(err["error"], dict):  # an OpenAI route's error: OpenAI's error object
        from openai.types import ErrorObject

        body = ErrorObject.model_validate(err["error"], strict=True)
        assert body.code in (err["error_kind"], "context_length_exceeded"), err
        err = {"error": body.message, "error_kind": err["error_kind"]}
    assert isinstance(err["error"], str), err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@contextlib.contextmanager
def api_server(env: dict | None = None, log_path: str | None = None):
    """`python handler.py --rp_serve_api` on a free loopback port; yields (base_url, process)."""
    port = free_port()
    cmd = [sys.executable, "-u", "handler.py", "--rp_serve_api", "--rp_api_host", "127.0.0.1", "--rp_api_port",
           str(port)]  # fmt: skip
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **WORKER_ENV, **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the API server exited with {proc.returncode} (log: {log_path})")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the API server did not start listening within 120 s")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()
