"""Property test: random and malformed job inputs through handler.handler — every one gets results or one typed
error as its last output, nothing raises, every output is strict JSON, and the worker still serves afterwards. The
inputs include worker-vllm's native shape, logprobs, and structured output (schemas and grammars, valid or not)."""

from __future__ import annotations

import json
import time
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.text.chat import RESERVED
from tests.worker_support import handler_module, run_job, typed_error

STATS: Counter = Counter()

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                        max_size=4), max_leaves=10)  # fmt: skip
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", " Paris", "<|im_start|>", "<|im_end|>", "<think>", "\x00", "é" * 7, "word " * 90]),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3),  # lone surrogates
)


messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]),
     "content": texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)},
    optional={"name": texts}), min_size=1, max_size=4)  # fmt: skip
sampling = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, 50),
    "top_p": st.floats(0.05, 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(texts, max_size=3),
    "stream": st.booleans(),
}
template_kwargs = st.dictionaries(st.text(max_size=8), scalars, max_size=2)
with_messages = st.fixed_dictionaries({"messages": messages}, optional={"chat_template_kwargs": template_kwargs})
prompt_or_messages = st.one_of(st.fixed_dictionaries({"prompt": texts}), with_messages)


def merged(*parts):
    return st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})


system1 = merged(prompt_or_messages, st.fixed_dictionaries(
    {"candidates": st.lists(texts, min_size=1, max_size=4)},
    optional={"mode": st.just("system1"), "temperature": st.floats(0.01, 5)}))  # fmt: skip
generate = merged(prompt_or_messages, st.fixed_dictionaries({}, optional={"mode": st.just("generate"), **sampling}))
# Structured output: schemas that compile, schemas that do not (any JSON value), grammars good and bad.
schemas = st.one_of(
    st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"enum": ["a", "b"]},
                     {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                     {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, {"type": "nonsense"},
                     {"$ref": "#/missing"}, {"properties": 5}]),
    st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "required", "$ref"]), anything,
                    max_size=3),
)  # fmt: skip
response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"schema": schemas}, optional={"name": texts, "strict": st.booleans()})}),
)  # fmt: skip
grammars = st.sampled_from(['root ::= "yes" | "no"', 'start: "a"+', "root ::=", 'root ::= "open', "%%", ""]) | texts
openai_sampling = {**sampling, "stop": texts | st.lists(texts, max_size=3), "n": st.just(1), "model": texts,
                   "response_format": response_formats, "grammar": grammars}  # fmt: skip
chat_only = {"logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25)}
chat = st.fixed_dictionaries({"openai_route": st.just("/v1/chat/completions"), "openai_input": merged(
    st.fixed_dictionaries({"messages": messages}),
    st.fixed_dictionaries({}, optional={**openai_sampling, **chat_only}))})  # fmt: skip
completion = st.fixed_dictionaries({"openai_route": st.just("/v1/completions"), "openai_input": merged(
    st.fixed_dictionaries({"prompt": texts | st.lists(texts, min_size=1, max_size=1)}),
    st.fixed_dictionaries({}, optional={**openai_sampling, "logprobs": st.integers(-1, 25)}))})  # fmt: skip
vllm_sampling = {**sampling, "top_k": st.integers(-2, 50), "n": st.integers(0, 2), "ignore_eos": st.booleans(),
                 "logprobs": st.none() | st.integers(0, 3), "repetition_penalty": st.floats(0, 2)}  # fmt: skip
vllm_native = merged(prompt_or_messages.map(lambda d: {k: v for k, v in d.items() if k != "chat_template_kwargs"}),
                     st.fixed_dictionaries({"sampling_params": st.fixed_dictionaries({}, optional=vllm_sampling)},
                                           optional={"stream": st.booleans(), "apply_chat_template": st.booleans(),
                                                     "min_batch_size": st.integers(0, 5),
                                                     "batch_size_growth_factor": st.floats(0, 4)}))  # fmt: skip
models = st.fixed_dictionaries({"openai_route": st.just("/v1/models")})
plausible = st.one_of(system1, generate, chat, completion, models, vllm_native)


@st.composite
def corrupted(draw):
    """A plausible job with one field deleted, replaced by any JSON value, or added."""
    job = dict(draw(plausible))
    inner = job.get("openai_input") if isinstance(job.get("openai_input"), dict) else None
    target = inner if inner is not None and draw(st.booleans()) else job
    key = draw(st.sampled_from([*sorted(target), "bogus", "prompt", "messages", "candidates", "max_tokens", "stream"]))
    if key in target and draw(st.booleans()):
        del target[key]
    else:
        target[key] = draw(anything)
    return job


def _nested(depth: int) -> list:
    outer = inner = []
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


@st.composite
def hostile(draw):
    """A plausible job with one hostile part: an oversized or wrong-typed list at a typed field, a huge string, a
    huge object, deep nesting, or a template variable the engine sets itself."""
    job = dict(draw(st.one_of(system1, generate)))
    kind = draw(st.sampled_from(["list", "string", "object", "nesting", "reserved"]))
    if kind == "list":
        n = draw(st.sampled_from([17, 1025, 5000, 200_000]))  # over every limit (16 stop strings, 8 candidates)
        element = draw(st.sampled_from([1, None, "x", {}, [], {"role": "user", "content": 1}]))
        field = draw(st.sampled_from(["candidates", "messages", "stop", "content", "anything"]))
        if field == "content":
            job.pop("prompt", None)
            job["messages"] = [{"role": "user", "content": [element] * n}]
        else:
            job[field] = [element] * n
    elif kind == "string":
        job[draw(st.sampled_from(["prompt", "bogus", "mode"]))] = "x" * draw(st.sampled_from([4001, 1_000_000]))
    elif kind == "object":
        job["chat_template_kwargs"] = {str(i): i for i in range(draw(st.sampled_from([17, 2000, 100_000])))}
    elif kind == "nesting":
        job["prompt"] = _nested(draw(st.sampled_from([17, 65, 10_000])))
    else:
        job.pop("prompt", None)
        job["messages"] = [{"role": "user", "content": "Hi"}]
        job["chat_template_kwargs"] = {draw(st.sampled_from(sorted(RESERVED))): draw(scalars)}
    return job


job_inputs = st.one_of(anything, plausible, plausible, corrupted(), hostile())


SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@settings(max_examples=2500, deadline=None, derandomize=True, suppress_health_check=SLOW_OK)
@given(job_input=job_inputs)
def test_every_input_gets_results_or_a_typed_error(job_input):
    handler = handler_module().handler
    outputs = run_job(handler, job_input)
    assert outputs, job_input
    assert all(typed_error(o) is None for o in outputs[:-1])
    json.dumps(outputs, allow_nan=False)  # what the platform sends must be strict JSON
    error = typed_error(outputs[-1])
    STATS["cases"] += 1
    STATS[f"error:{error['error_kind']}" if error else "result"] += 1
    if error is None and isinstance(outputs[-1], dict) and "error" not in outputs[-1]:
        # a result carries its timings; /v1/models is a list; worker-vllm's shape is its own
        assert "cold_start" in outputs[-1] or outputs[-1].get("object") == "list" or "choices" in outputs[-1]


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=SLOW_OK)
@given(job_input=hostile())
def test_hostile_jobs_are_invalid_input_and_cheap(job_input):
    handler = handler_module().handler
    t0 = time.perf_counter()
    (out,) = run_job(handler, job_input)
    elapsed = time.perf_counter() - t0
    error = typed_error(out)
    STATS["hostile"] += 1
    assert error is not None and error["error_kind"] == "invalid_input", (str(job_input)[:200], out)
    assert elapsed < 1.0 and len(error["error"]) < 600, (elapsed, error)


def test_the_worker_still_serves_after_the_fuzzing():
    handler = handler_module().handler
    print(json.dumps(dict(STATS)))
    (out,) = run_job(handler, {"prompt": "The capital of France is", "candidates": [" Paris", " London"]})
    assert typed_error(out) is None and len(out["candidates"]) == 2
    assert STATS["cases"] == 0 or STATS["result"] > STATS["cases"] // 20  # the fuzzing reached the engine too
