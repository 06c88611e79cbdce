"""The worker as its local modes run it, in fresh processes: `python handler.py`, `--test_input`, and the
`--rp_serve_api` server on a loopback port (the CI flow, streaming through /run + /stream, and a 1,000-job soak)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from engine.errors import EngineError
from tests.worker_support import ROOT, WORKER_ENV, api_server, post, rss_kb

PROMPT = "The capital of France is"
SYSTEM1 = {"prompt": PROMPT, "candidates": [" Paris", " London"]}
GENERATE = {"prompt": PROMPT, "max_tokens": 8}
CHAT = {"openai_route": "/v1/chat/completions",
        "openai_input": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}  # fmt: skip
INVALID = {"prompt": PROMPT, "max_tokens": "many"}


def run_handler(*args: str, env: dict) -> tuple[int, list | dict | None, str]:
    """(exit code, the job's output as the SDK logs it, all output) of `python handler.py ARGS`."""
    p = subprocess.run([sys.executable, "-u", "handler.py", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    text = p.stdout + p.stderr
    result = next((ast.literal_eval(line.split("Job result: ", 1)[1]) for line in text.splitlines()
                   if "Job result: " in line), None)  # fmt: skip
    return p.returncode, result and result.get("output"), text


def tiny_env(**extra) -> dict:
    return {**os.environ, **WORKER_ENV, "RUNPOD_LOG_LEVEL": "INFO", **extra}


def test_python_handler_runs_test_input_json_on_the_default_model():
    from engine.bundled import default_model_path

    env = {k: v for k, v in os.environ.items() if k not in WORKER_ENV}
    env.pop("MODEL_PATH", None)
    try:
        default_model_path()
    except EngineError as e:
        pytest.skip(str(e))
    code, output, text = run_handler(env={**env, "RUNPOD_LOG_LEVEL": "INFO"})
    assert code == 0, text
    (result,) = output
    assert result["best_text"] == " Paris" and result["model"]["arch"] == "llama" and result["backend"] == "cpu"
    cold = result["cold_start"]
    for key in ("imports_ms", "gguf_open_ms", "model_load_ms", "process_start_to_ready_ms", "runpod_import_ms",
                "runpod_import_wait_ms", "process_start_to_worker_ready_ms", "process_start_to_first_job_ms",
                "process_start_to_result_ms"):  # fmt: skip
        assert isinstance(cold[key], float), key
    assert cold["process_start_to_result_ms"] >= cold["process_start_to_worker_ready_ms"]


def test_test_input_runs_a_streaming_job_and_fails_on_an_error():
    job = {"input": {"prompt": "Hello", "max_tokens": 5, "stream": True}}
    code, output, text = run_handler("--test_input", json.dumps(job), env=tiny_env())
    assert code == 0, text
    *chunks, result = output  # iterated, though the SDK alone would print a generator object here
    assert "".join(c["text"] for c in chunks) == result["text"] and result["cold_start"]["runpod_import_ms"] > 0
    code, output, text = run_handler("--test_input", json.dumps({"input": INVALID}), env=tiny_env())
    assert code == 1 and "invalid_input" in text


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with api_server(log_path=log) as (url, proc):
        yield url, proc


def runsync(url: str, job_input) -> dict:
    response = post(url + "/runsync", {"input": job_input})
    assert response["status"] == "COMPLETED", response  # the dev server reports handler errors as outputs
    return response


def output_error(response: dict) -> dict | None:
    last = response["output"][-1]
    return json.loads(last["error"]) if isinstance(last, dict) and "error" in last else None


def test_ci_flow_through_runsync(server):
    url, _ = server
    (s1,) = runsync(url, SYSTEM1)["output"]
    assert s1["best_text"] in (" Paris", " London") and s1["backend"] == "cpu"
    (gen,) = runsync(url, GENERATE)["output"]
    assert gen["usage"]["completion_tokens"] == len(gen["token_ids"]) >= 1
    (chat,) = runsync(url, CHAT)["output"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    bad = runsync(url, INVALID)
    assert output_error(bad)["error_kind"] == "invalid_input" and len(bad["output"]) == 1
    (again,) = runsync(url, SYSTEM1)["output"]
    assert again["candidates"] == s1["candidates"] and again["cold_start"] is None


def test_streaming_through_run_and_stream(server):
    url, _ = server
    job = post(url + "/run", {"input": {"prompt": "Hello", "max_tokens": 16, "stream": True}})
    assert job["status"] == "IN_PROGRESS"
    streamed = post(url + f"/stream/{job['id']}", {})
    assert streamed["status"] == "COMPLETED"
    *chunks, result = [item["output"] for item in streamed["stream"]]
    assert len(chunks) >= 2 and [len(c["token_ids"]) for c in chunks][:2] == [1, 3]
    assert "".join(c["text"] for c in chunks) == result["text"]
    sse = runsync(url, {**CHAT, "openai_input": {**CHAT["openai_input"], "stream": True}})["output"]
    assert sse[-1].endswith("data: [DONE]\n\n") and all(s.startswith("data: ") for s in sse)


def test_soak_1000_jobs_without_failures_or_memory_growth(server):
    url, proc = server
    mix = [SYSTEM1, GENERATE, {**GENERATE, "stream": True}, CHAT, INVALID]
    failures, baseline = [], None
    for i in range(1000):
        job = mix[i % len(mix)]
        response = post(url + "/runsync", {"input": job})
        error = output_error(response) if response.get("status") == "COMPLETED" else {"error_kind": "FAILED"}
        if (error is not None) != (job is INVALID) or (error and error["error_kind"] != "invalid_input"):
            failures.append((i, response))
        if i == 99:  # after warm-up: allocator pools, caches and lazily imported modules are in place
            baseline = rss_kb(proc.pid)
    final = rss_kb(proc.pid)
    growth = (final - baseline) / baseline
    print(json.dumps({"soak_jobs": 1000, "failures": len(failures), "rss_kb_after_100": baseline,
                      "rss_kb_after_1000": final, "rss_growth": round(growth, 4)}))  # fmt: skip
    assert not failures, failures[:3]
    assert growth < 0.05, (baseline, final)
