"""Hostile job inputs: whatever their size, rejecting them costs milliseconds and no memory worth naming, the error
is typed and says what was wrong, and settings from the environment fail with one kind.

The sizes are those that made the unbounded paths cost seconds and gigabytes (pydantic recording one error per
element of a wrong-typed list: 9 s and 2.4 GB for 2M integer candidates)."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from engine.errors import InvalidInput
from engine.worker import jobs
from engine.worker.limits import Limits
from engine.worker.service import Worker
from tests.worker_support import TINY, handler_module, run_job, typed_error

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


def nested(depth: int) -> list:
    """[[[...]]] `depth` deep (built iteratively: JSON parsers stop far earlier, Python objects need not)."""
    outer = inner = []
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


HOSTILE = {
    "2M integer candidates": ({"prompt": "a", "candidates": [1] * 2_000_000}, "candidates: 2000000 items"),
    "1M messages": ({"messages": [{"role": "user", "content": "x"}] * 1_000_000}, "messages: 1000000 items"),
    "1M content parts": ({"messages": [{"role": "user", "content": [1] * 1_000_000}]}, "content: 1000000 items"),
    "1M stop strings": ({"prompt": "a", "stop": ["x"] * 1_000_000}, "stop: 1000000 items"),
    "1M-key logit_bias": (
        {
            "openai_route": CHAT,
            "openai_input": {"messages": USER, "logit_bias": dict.fromkeys(map(str, range(1_000_000)), "x")},
        },
        "logit_bias: 1000000 keys",
    ),
    "50M-character prompt": ({"prompt": "x" * 50_000_000}, "prompt has 50000000 characters"),
    "1M-character key": ({"prompt": "a", "k" * 1_000_000: 1}, "object key"),
    "100k-deep nesting": ({"prompt": "a", "x": nested(100_000)}, "nested deeper"),
    "65k wrong-typed values": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}] * 20}] * 1000},
        "Input should be a valid string",
    ),
    "2M-item list elsewhere": (
        {"openai_route": CHAT, "openai_input": {"messages": USER, "tools": [0] * 2_000_000}},
        "tools: 2000000 items",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_rejecting_a_hostile_job_is_fast_small_and_says_why(name):
    raw, match = HOSTILE[name]
    t0 = time.perf_counter()
    with pytest.raises(InvalidInput, match=match) as e:
        jobs.parse(raw)
    elapsed = time.perf_counter() - t0
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput):
            jobs.parse(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0 and peak < 20 << 20, (elapsed, peak)
    assert len(str(e.value)) < 600


def test_typed_lists_report_one_error_not_one_per_element():
    with pytest.raises(InvalidInput) as e:
        jobs.parse({"prompt": "a", "candidates": [1] * 60}, Limits(max_candidates=64))
    assert "candidates.0: Input should be a valid string" in str(e.value) and "more" not in str(e.value)


@pytest.mark.parametrize("kwargs", [{"bos_token": "x"}, {"messages": "x"}, {"add_generation_prompt": False},
                                    {"raise_exception": 1}, {"self": 1}, {"range": 1}])  # fmt: skip
def test_reserved_template_variables_are_invalid_input(kwargs):
    handler = handler_module().handler
    chat = {"messages": USER, "chat_template_kwargs": kwargs}
    for job in (chat, {"openai_route": CHAT, "openai_input": chat}):
        (out,) = run_job(handler, job)
        err = typed_error(out)
        assert err["error_kind"] == "invalid_input" and "set by the engine" in err["error"], err


def test_bad_settings_share_one_kind_and_name_the_variable(monkeypatch):
    for var in ("MAX_PROMPT_CHARS", "MAX_NEW_TOKENS", "MAX_CANDIDATES", "MAX_SEQ_LEN"):
        for bad in ("abc", "0", "-5", "1.5"):
            monkeypatch.setenv(var, bad)
            worker = Worker.load(TINY)
            (out,) = [o for o in worker.run({"prompt": "Hi"}) if o is not None]
            assert out["error_kind"] == "invalid_input" and var in out["error"], (var, bad, out)
            monkeypatch.delenv(var)
