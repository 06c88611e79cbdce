"""The job schemas' validators are built lazily (engine/worker/jobs.py: `build`, `build_system1`): a cold worker
builds only the system1 job's before its first job. Each check runs in a fresh interpreter, where nothing is built
yet: parsing every kind of job, valid or not, with each validator built on first use must give what it gives with
all of them built first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.worker_support import ROOT

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
# Every kind parse tells apart, valid and invalid (wrong types, unknown fields, limits, cross-field rules).
INPUTS = [
    {"prompt": "a", "candidates": [" b", " c"], "temperature": 0.5},
    {"mode": "system1", "messages": MESSAGES, "candidates": [" b"]},
    {"prompt": "a", "candidates": []},
    {"prompt": "a", "candidates": [" b"], "temperature": 0},
    {"prompt": "a", "messages": MESSAGES, "candidates": [" b"]},
    {"prompt": "a", "max_tokens": 5, "stop": ["\n"], "seed": 3, "stream": True},
    {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
    {"prompt": "a", "max_tokens": "5"},
    {"prompt": "a", "top_p": 0.0, "colour": "red"},
    {"messages": MESSAGES, "chat_template_kwargs": {"messages": 1}},
    {"mode": "other", "prompt": "a"},
    {"openai_route": "/v1/models"},
    {"openai_route": "/v1/embeddings"},
    {"openai_route": CHAT, "openai_input": {"messages": MESSAGES, "logprobs": True, "top_logprobs": 1}},
    {"openai_route": CHAT, "openai_input": {"messages": MESSAGES, "stream": True, "stream_options": {}}},
    {"openai_route": CHAT, "openai_input": {"messages": MESSAGES, "n": 2, "top_logprobs": 1}},
    {"openai_route": CHAT, "openai_input": {"messages": MESSAGES, "response_format": {"type": "json_schema"}}},
    {"openai_route": CHAT, "openai_input": {"messages": MESSAGES, "tools": []}},
    {"openai_route": "/v1/completions", "openai_input": {"prompt": ["a"], "logprobs": 2, "echo": False}},
    {"openai_route": "/v1/completions", "openai_input": {"prompt": ["a", "b"], "best_of": 2}},
    {"openai_route": "/v1/completions", "openai_input": {"prompt": "a", "max_tokens": 10**6}},
]

# argv: "lazy" (each validator built by its first parse) or "eager" (jobs.build() first); prints what parse gave for
# each input, then which models were built after the first (system1) parse and whether pydantic's plugin loader
# (and importlib.metadata, which it imports) was loaded by then.
CODE = """
import json, sys
from engine.errors import InvalidInput
from engine.worker import jobs

if sys.argv[1] == "eager":
    jobs.build()
elif sys.argv[1] == "system1":
    jobs.build_system1()
answers, first = [], None
for raw in json.loads(sys.argv[2]):
    try:
        job = jobs.parse(raw, jobs.Limits(max_new_tokens=100))
        answers.append([type(job).__name__, job.model_dump(mode="json")])
    except InvalidInput as e:
        answers.append(["InvalidInput", str(e)])
    if first is None:
        first = {"built": [m.__name__ for m in jobs.MODELS if m.__pydantic_complete__],
                 "loaded": sorted({"pydantic.plugin._loader", "importlib.metadata"} & set(sys.modules))}
print(json.dumps({"answers": answers, "first": first}))
"""


def _parsed(mode: str, plugins_off: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    if plugins_off:
        env["PYDANTIC_DISABLE_PLUGINS"] = "__all__"  # the worker's setting (engine/worker/serverless.py)
    p = subprocess.run([sys.executable, "-c", CODE, mode, json.dumps(INPUTS)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("plugins_off", [True, False])
def test_lazily_built_validators_parse_every_kind_as_the_eagerly_built_ones(plugins_off):
    eager = _parsed("eager", plugins_off)["answers"]
    assert [kind for kind, _ in eager].count("InvalidInput") >= 10 and len({kind for kind, _ in eager}) == 6
    assert _parsed("lazy", plugins_off)["answers"] == eager
    assert _parsed("system1", plugins_off)["answers"] == eager


def test_the_first_system1_job_builds_its_validator_only_and_searches_no_plugins():
    first = _parsed("system1")["first"]
    assert first == {"built": ["System1Job"], "loaded": []}
    first = _parsed("lazy")["first"]  # built by the parse itself
    assert first == {"built": ["System1Job"], "loaded": []}


def test_with_plugins_allowed_pydantic_searches_them_as_usual():
    assert "pydantic.plugin._loader" in _parsed("system1", plugins_off=False)["first"]["loaded"]
