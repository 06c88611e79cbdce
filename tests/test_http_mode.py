"""Load-balancing endpoint mode (engine/worker/http.py) on loopback: /ping through loading, the OpenAI routes through
the `openai` client itself, the native routes, and the request limits (413, 429, 504); then `PORT=... python
handler.py` as the image starts it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from engine.worker.http import App, HttpLimits
from engine.worker.service import Worker
from tests.worker_support import ROOT, TINY, WORKER_ENV, free_port

ENV = {"MAX_SEQ_LEN": "4096", "MAX_NEW_TOKENS": "4000"}
USER = [{"role": "user", "content": "Name a colour."}]


def request(url: str, body: dict | bytes | None = None, method: str | None = None, timeout: float = 60):
    """(status, parsed JSON or text or None, headers) of one HTTP request, errors included."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, headers = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), e.headers
    text = raw.decode()
    with contextlib.suppress(ValueError):
        return status, json.loads(text) if text else None, headers
    return status, text, headers


@contextlib.contextmanager
def serving(app: App):
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app.asgi, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def loaded():
    gate = threading.Event()

    def load():
        gate.wait(30)
        return Worker.load(TINY, env=ENV)

    app = App(load, HttpLimits(max_body_bytes=64 << 10, max_queue=2, request_timeout_s=2))
    with serving(app) as url:
        app.start_loading()
        status, _, _ = request(url + "/ping")
        assert status == 204  # loading
        assert request(url + "/v1/models")[0] == 503
        gate.set()
        deadline = time.monotonic() + 60
        while request(url + "/ping")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield url, app


def test_openai_client_against_the_http_mode(loaded):
    url, _ = loaded
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="x", messages=USER, max_tokens=5, temperature=0, logprobs=True)
    assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].logprobs.content) >= 1
    stream = client.chat.completions.create(model="x", messages=USER, max_tokens=5, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    completion = client.completions.create(model="x", prompt="Hello", max_tokens=3, temperature=0)
    assert completion.object == "text_completion" and completion.usage.completion_tokens >= 1
    (model,) = client.models.list().data
    assert model.id == "qwen3-tiny-q8_0"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=USER, n=3)
    assert e.value.status_code == 400 and "n=3" in e.value.message


def test_native_routes(loaded):
    url, _ = loaded
    status, body, _ = request(url + "/system1", {"prompt": "The capital of France is", "candidates": [" Paris", " a"]})
    assert status == 200 and len(body["candidates"]) == 2
    status, body, _ = request(url + "/generate", {"prompt": "Hello", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    status, body, _ = request(url + "/generate", {"prompt": "Hello", "max_tokens": "x"})
    assert status == 400 and body["error_kind"] == "invalid_input"
    status, body, _ = request(url + "/system1", b"{not json")
    assert status == 400 and body["error_kind"] == "invalid_input"


def test_limits_413_429_504(loaded):
    url, app = loaded
    status, body, _ = request(url + "/v1/completions", {"prompt": "x" * (80 << 10)})
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    long = {"prompt": "Hello", "max_tokens": 4000, "temperature": 0}
    results = []
    threads = [threading.Thread(target=lambda: results.append(request(url + "/v1/completions", long)))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    time.sleep(0.3)
    status, _, headers = request(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 429 and headers["Retry-After"] == "1"
    for t in threads:
        t.join(30)
    assert sorted(r[0] for r in results) == [504, 504]  # 4000 tokens: ~4 s on an idle 2-core machine, past 2 s
    assert app.engine_thread.wait_idle(10) and app.in_flight == 0
    status, body, _ = request(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1  # the engine was freed


def test_handler_py_with_port_serves_http():
    port = free_port()
    env = {**os.environ, **WORKER_ENV, "PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-u", "handler.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "handler.py exited"
            with contextlib.suppress(OSError):
                if request(f"http://127.0.0.1:{port}/ping", timeout=2)[0] == 200:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        status, body, _ = request(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and body["data"][0]["id"] == "qwen3-tiny-q8_0"
    finally:
        proc.terminate()
        proc.wait(20)
