"""Hostile jobs through the worker as it runs (`handler.py --rp_serve_api`): large wrong-typed bodies cost the
worker nothing beyond the SDK's own JSON decoding, and a soak that mixes hostile jobs with real ones keeps every
answer typed and the memory flat."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.worker_support import api_server, post, rss_kb

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
GOOD = [
    {"prompt": "The capital of France is", "candidates": [" Paris", " London"]},
    {"prompt": "The capital of France is", "max_tokens": 4},
    {"openai_route": CHAT, "openai_input": {"messages": USER, "max_tokens": 3}},
]
HOSTILE = [  # (job input, or its JSON text; the error's fragment)
    ({"prompt": "a", "candidates": [1] * 100_000}, "candidates: 100000 items"),
    ({"messages": [{"role": "user", "content": [1] * 100_000}]}, "content: 100000 items"),
    ({"messages": USER, "chat_template_kwargs": {"bos_token": "x"}}, "set by the engine"),
    ({"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}, "set by the engine"),
    ({"prompt": "x" * 100_000}, "MAX_PROMPT_CHARS"),
    ('{"prompt": "a", "x": ' + "[" * 500 + "]" * 500 + "}", "nested deeper"),
    (
        {"openai_route": CHAT, "openai_input": {"messages": USER, "logit_bias": {str(i): 1 for i in range(5000)}}},
        "5000 keys",
    ),
    ({"prompt": "a", "max_tokens": float("nan")}, "max_tokens"),
]


def post_text(url: str, text: str, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=text.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def runsync(url: str, job) -> dict:
    """The job's last output, its typed error decoded when it is one."""
    text = '{"input": ' + job + "}" if isinstance(job, str) else json.dumps({"input": job}, separators=(",", ":"))
    response = post_text(url + "/runsync", text)
    assert response["status"] == "COMPLETED", response
    last = response["output"][-1]
    return json.loads(last["error"]) if isinstance(last, dict) and "error" in last else last


def error_message(out: dict) -> str:
    return out["error"]["message"] if isinstance(out["error"], dict) else out["error"]  # OpenAI routes: their shape


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with api_server(log_path=str(tmp_path_factory.mktemp("hostile") / "server.log")) as (url, proc):
        for job in GOOD:  # warm: the lazily imported modules and the allocator's pools are in place
            runsync(url, job)
        yield url, proc


def test_a_4_mb_wrong_typed_body_costs_only_its_decoding(server):
    url, proc = server
    before = rss_kb(proc.pid)
    bodies = [
        ({"prompt": "a", "candidates": [1] * 2_000_000}, "candidates: 2000000 items"),
        ({"messages": [{"role": "user", "content": [1] * 2_000_000}]}, "content: 2000000"),
    ]
    for job, fragment in bodies:
        t0 = time.perf_counter()
        out = runsync(url, job)
        elapsed = time.perf_counter() - t0
        assert out["error_kind"] == "invalid_input" and fragment in error_message(out), out
        print(json.dumps({"body_mb": 4, "seconds": round(elapsed, 3), "rss_mb": round(rss_kb(proc.pid) / 1024, 1)}))
        assert elapsed < 10.0  # the SDK's JSON decoding and request model; the handler's own part is milliseconds
    assert rss_kb(proc.pid) - before < 100 << 10
    assert "error" not in runsync(url, GOOD[0])


def test_soak_of_hostile_and_real_jobs(server):
    url, proc = server
    failures, baseline = [], None
    mix = [*((job, None) for job in GOOD), *HOSTILE]
    for i in range(220):
        job, fragment = mix[i % len(mix)]
        out = runsync(url, job)
        is_error = isinstance(out, dict) and "error_kind" in out
        if (fragment is None) == is_error or (fragment and fragment not in error_message(out)):
            failures.append((i, str(out)[:200]))
        if fragment is not None and out.get("error_kind") != "invalid_input":
            failures.append((i, str(out)[:200]))
        if i == len(mix) * 2 - 1:
            baseline = rss_kb(proc.pid)
    final = rss_kb(proc.pid)
    print(json.dumps({"soak_jobs": 220, "failures": len(failures), "rss_kb_baseline": baseline, "rss_kb_final": final}))
    assert not failures, failures[:3]
    assert (final - baseline) / baseline < 0.05, (baseline, final)
    assert post(url + "/runsync", {"input": GOOD[1]})["status"] == "COMPLETED"
