"""worker-vllm compatibility, OpenAI shapes checked against the `openai` package's types, logprobs, the thinking
split, and structured output (JSON schema, grammar) on the CPU backend with the tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from openai.types import Completion, ErrorObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.errors import InvalidInput
from engine.worker import reasoning
from engine.worker.service import Worker
from engine.worker.vllm import Settings
from tests.worker_support import TINY, handler_module, run_job, typed_error

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Name a colour."}]
AGE = {"type": "integer", "minimum": 0, "maximum": 150}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": AGE},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def handler():
    return handler_module().handler


@pytest.fixture(scope="module")
def worker():
    return handler_module().worker


@pytest.fixture(scope="module")
def roomy():
    """A worker on the tiny model with room for whole JSON answers (its vocabulary has 1,024 short tokens)."""
    return Worker.load(TINY, env={"MAX_SEQ_LEN": "512", "MAX_NEW_TOKENS": "256"})


def answer(worker: Worker, job_input) -> dict:
    out = [o for o in worker.run(job_input) if o is not None]
    assert len(out) == 1 and "error" not in out[0], out
    return out[0]


def one(handler, job_input):
    out = run_job(handler, job_input)
    assert len(out) == 1 and typed_error(out[0]) is None, out
    return out[0]


def events(outputs: list[str]) -> list:
    found = []
    for text in outputs:
        for block in text.strip().split("\n\n"):
            payload = block.removeprefix("data: ")
            found.append(payload if payload == "[DONE]" else json.loads(payload))
    return found


# -- worker-vllm ------------------------------------------------------------------------------------------------


def test_worker_vllm_native_job_streamed_and_not(handler, worker):
    job = {"prompt": "Hello", "sampling_params": {"max_tokens": 12, "temperature": 0, "top_k": -1}}
    (whole,) = run_job(handler, job)
    native = worker.engine.generate("Hello", max_tokens=12)
    usage = {"input": native["usage"]["prompt_tokens"], "output": len(native["token_ids"])}
    assert whole == {"choices": [{"tokens": [native["text"]]}], "usage": usage}
    streamed = run_job(handler, {**job, "stream": True, "min_batch_size": 2, "batch_size_growth_factor": 2})
    sizes = [len(b["choices"][0]["tokens"]) for b in streamed]
    assert sizes[0] == 2 and sizes[1:2] in ([4], []) and sum(sizes) == len(native["token_ids"])
    assert "".join(t for b in streamed for t in b["choices"][0]["tokens"]) == native["text"]
    assert streamed[-1]["usage"]["output"] == len(native["token_ids"])
    chat = one(handler, {"messages": USER, "sampling_params": {"max_tokens": 4, "temperature": 0}})
    templated = worker.engine.generate(worker.engine.apply_chat_template(USER), max_tokens=4)
    assert chat["choices"][0]["tokens"] == [templated["text"]]
    as_chat = one(handler, {"prompt": USER[0]["content"], "apply_chat_template": True,
                            "sampling_params": {"max_tokens": 4, "temperature": 0}})  # fmt: skip
    assert as_chat == chat


@pytest.mark.parametrize(
    ("sampling", "match"),
    [({"n": 2}, "n=2 is not supported"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
     ({"max_tokens": 17}, "MAX_NEW_TOKENS"), ({"bogus": 1}, "Extra inputs"), ({"temperature": "hot"}, "temperature")],
)  # fmt: skip
def test_worker_vllm_unsupported_sampling_is_a_typed_error(handler, sampling, match):
    (out,) = run_job(handler, {"prompt": "Hello", "sampling_params": sampling})
    err = typed_error(out)
    assert err["error_kind"] == "invalid_input" and match in err["error"], err


def test_worker_vllm_env_names(monkeypatch):
    env = {"MAX_MODEL_LEN": "96", "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "my-model", "DEFAULT_BATCH_SIZE": "10",
           "DEFAULT_MIN_BATCH_SIZE": "2", "BATCH_SIZE_GROWTH_FACTOR": "4",
           "CUSTOM_CHAT_TEMPLATE": "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"}  # fmt: skip
    assert Settings.from_env(env) == Settings(96, "my-model", env["CUSTOM_CHAT_TEMPLATE"], 2, 4, 10)
    assert Settings.from_env({**env, "MAX_SEQ_LEN": "64"}).max_seq_len is None  # the worker's own name wins
    w = Worker.load(TINY, env=env)
    assert w.engine.max_seq == 96 and w.served_name == "my-model"
    assert w.engine.apply_chat_template([{"role": "user", "content": "hi"}]) == "<<hi>>"
    (models,) = [o for o in w.run({"openai_route": "/v1/models"}) if o is not None]
    assert models["data"][0]["id"] == "my-model" and models["data"][0]["max_model_len"] == 96
    for bad in ({"MAX_MODEL_LEN": "lots"}, {"DEFAULT_BATCH_SIZE": "0"}, {"KV_CACHE_DTYPE": "int4"},
                {"KV_CACHE_TYPE": "fp8"}):  # fmt: skip
        with pytest.raises(InvalidInput, match=next(iter(bad))):
            Settings.from_env(bad)


def test_kv_cache_dtype_maps_to_the_engines_cache_type():
    assert Settings.from_env({}).kv_cache_type is None  # the engine reads KV_CACHE_TYPE itself
    assert Settings.from_env({"KV_CACHE_DTYPE": "auto"}).kv_cache_type is None
    assert Settings.from_env({"KV_CACHE_DTYPE": "fp8_e5m2"}).kv_cache_type == "f16"  # the smallest this engine has
    assert Settings.from_env({"KV_CACHE_DTYPE": "fp8", "KV_CACHE_TYPE": "f32"}).kv_cache_type == "f32"  # ours wins
    w = Worker.load(TINY, env={"KV_CACHE_DTYPE": "float16"})
    assert w.engine.model_info["kv_cache_type"] == "f16"


# -- OpenAI shapes, logprobs ------------------------------------------------------------------------------------


def test_responses_and_chunks_are_the_openai_packages_types(handler):
    body = {"messages": USER, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    chat = ChatCompletion.model_validate(one(handler, {"openai_route": CHAT, "openai_input": body}))
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    for c in content:  # greedy: the chosen token is the most likely, and the alternatives come best first
        assert c.logprob <= 0 and math.isclose(c.logprob, c.top_logprobs[0].logprob)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
    stream = events(run_job(handler, {"openai_route": CHAT, "openai_input": {**body, "stream": True}}))
    chunks = [ChatCompletionChunk.model_validate(e) for e in stream[:-1]]
    assert stream[-1] == "[DONE]"
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    comp = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    completion = Completion.model_validate(one(handler, {"openai_route": "/v1/completions", "openai_input": comp}))
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == completion.usage.completion_tokens
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)
    events_c = events(run_job(handler, {"openai_route": "/v1/completions", "openai_input": {**comp, "stream": True}}))
    for e in events_c[:-1]:
        # the package types completion stream chunks with the non-streamed model, whose finish_reason may not be
        # null; OpenAI's own streams send null until the last chunk, as these do: check everything else
        choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in e["choices"]]
        Completion.model_validate({**e, "choices": choices})
    assert [e["choices"][0]["finish_reason"] for e in events_c[:-1]][-1] in ("stop", "length")
    models = one(handler, {"openai_route": "/v1/models"})
    [Model.model_validate(card) for card in models["data"]]


def test_logprobs_are_log_softmax_of_the_models_logits(handler, worker):
    prompt = "The capital of France is"
    comp = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 3}
    out = one(handler, {"openai_route": "/v1/completions", "openai_input": comp})
    row = worker.engine.logits(worker.engine.tokenizer.encode(prompt))[-1].astype(np.float64)
    expect = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    lp = out["choices"][0]["logprobs"]
    # logits() runs every row through the prefill path, generation only the last: float32 rounding apart
    assert math.isclose(lp["token_logprobs"][0], float(expect.max()), abs_tol=1e-5)
    assert sorted(lp["top_logprobs"][0].values(), reverse=True) == pytest.approx(np.sort(expect)[::-1][:3], abs=1e-5)


def test_openai_route_errors_are_openai_error_objects(handler):
    for body, code in (({"messages": USER, "n": 2}, "invalid_input"),
                       ({"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 16},
                        "context_length_exceeded")):  # fmt: skip
        (out,) = run_job(handler, {"openai_route": CHAT, "openai_input": body})
        err = json.loads(out["error"])
        obj = ErrorObject.model_validate(err["error"])
        assert obj.code == code and obj.type == "invalid_request_error" and obj.message


def test_thinking_goes_to_reasoning_content(handler):
    body = {"messages": USER, "max_tokens": 16, "temperature": 0,
            "grammar": 'start: "<think>" "abc" "</think>" "\\n\\n" "Hello"'}  # fmt: skip
    msg = one(handler, {"openai_route": CHAT, "openai_input": body})["choices"][0]["message"]
    assert msg["reasoning_content"] == "abc" and msg["content"] == "Hello"
    stream = events(run_job(handler, {"openai_route": CHAT, "openai_input": {**body, "stream": True}}))
    deltas = [ChatCompletionChunk.model_validate(e).choices[0].delta for e in stream[:-1] if e["choices"]]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "abc"
    assert "".join(d.content or "" for d in deltas) == "Hello"
    assert reasoning.split("plain answer") == (None, "plain answer")
    assert reasoning.split("still thinking", opened_by_prompt=True) == ("still thinking", "")


# -- structured output ------------------------------------------------------------------------------------------


def matches_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["name"], str)
            and len(value["name"]) <= 8 and type(value["age"]) is int and 0 <= value["age"] <= 150)  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_json_schema_job_answers_json_that_validates(roomy, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    body = {"messages": USER, "max_tokens": 128, "temperature": 1.0, "seed": seed, "response_format": fmt}
    out = ChatCompletion.model_validate(answer(roomy, {"openai_route": CHAT, "openai_input": body}))
    assert out.choices[0].finish_reason == "stop"
    assert matches_schema(json.loads(out.choices[0].message.content)), out.choices[0].message.content


def test_json_object_and_a_gbnf_grammar(handler, roomy):
    body = {"messages": USER, "max_tokens": 128, "temperature": 0, "response_format": {"type": "json_object"}}
    text = answer(roomy, {"openai_route": CHAT, "openai_input": body})["choices"][0]["message"]["content"]
    assert isinstance(json.loads(text), dict)
    comp = {"prompt": "Answer:", "max_tokens": 8, "temperature": 1.0, "seed": 3, "grammar": 'root ::= "yes" | "no"'}
    out = one(handler, {"openai_route": "/v1/completions", "openai_input": comp})
    assert out["choices"][0]["text"] in ("yes", "no") and out["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "fmt",
    [{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}},
     {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": "a"}}},
     {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}],
)  # fmt: skip
def test_a_malformed_schema_is_invalid_input_and_the_worker_keeps_serving(handler, fmt):
    (out,) = run_job(handler, {"openai_route": CHAT, "openai_input": {"messages": USER, "response_format": fmt}})
    assert typed_error(out)["error_kind"] == "invalid_input"
    unclosed = {"messages": USER, "grammar": 'root ::= "open'}
    (bad_grammar,) = run_job(handler, {"openai_route": CHAT, "openai_input": unclosed})
    assert typed_error(bad_grammar)["error_kind"] == "invalid_input"
    one(handler, {"prompt": "Hi", "max_tokens": 2})
