"""Job input validation (engine/worker/jobs.py): kinds, strictness, limits, OpenAI compatibility fields."""

from __future__ import annotations

import pytest

from engine.errors import InvalidInput
from engine.worker import jobs

LIMITS = jobs.Limits(max_new_tokens=100, max_candidates=3, max_prompt_chars=50)
CHAT = "/v1/chat/completions"


def parse(raw):
    return jobs.parse(raw, LIMITS)


def rejects(raw, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        parse(raw)


def test_kinds_are_told_by_their_fields():
    assert isinstance(parse({"prompt": "a", "candidates": [" b"]}), jobs.System1Job)
    assert isinstance(parse({"mode": "system1", "prompt": "a", "candidates": [" b"]}), jobs.System1Job)
    assert isinstance(parse({"prompt": "a"}), jobs.GenerateJob)
    assert isinstance(parse({"mode": "generate", "messages": [{"role": "user", "content": "a"}]}), jobs.GenerateJob)
    assert isinstance(parse({"openai_route": "/v1/models"}), jobs.ModelsRequest)
    chat = parse({"openai_route": CHAT, "openai_input": {"messages": [{"role": "user", "content": "a"}]}})
    assert isinstance(chat, jobs.ChatCompletionRequest)
    done = parse({"openai_route": "/v1/completions", "openai_input": {"prompt": ["a"]}})
    assert isinstance(done, jobs.CompletionRequest) and done.text == "a"


def test_generate_defaults_follow_the_design():
    job = parse({"prompt": "a"})
    assert job.sampling(jobs.Limits()) == dict(max_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=[])
    assert job.stream is False
    assert job.sampling(jobs.Limits(max_new_tokens=10))["max_tokens"] == 10  # the default is capped, not refused


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ([1], "must be a JSON object"),
        ({"prompt": "a", "bogus": 1}, "bogus: Extra inputs are not permitted"),
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ({"prompt": "a", "max_tokens": 0}, "greater than or equal to 1"),
        ({"prompt": "a", "temperature": float("inf")}, "finite"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "seed": -1}, "seed"),
        ({"prompt": "a", "stop": "x"}, "stop: Input should be a valid list"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of prompt and messages"),
        ({}, "exactly one of prompt and messages"),
        ({"prompt": "a", "chat_template_kwargs": {"x": 1}}, "applies to messages only"),
        ({"messages": []}, "at least 1 item"),
        ({"messages": [{"role": "robot", "content": "b"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, "'text'"),
        ({"mode": "chat"}, "mode must be 'system1' or 'generate'"),
        ({"mode": "generate", "prompt": "a", "candidates": [" b"]}, "candidates: Extra inputs"),
        ({"prompt": "a", "candidates": []}, "at least 1 item"),
        ({"prompt": "a", "candidates": [" b"], "temperature": 0}, "greater than 0"),
        ({"prompt": "a\ud800"}, "prompt: text must be valid Unicode"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, r"messages\.0\.content: text must be valid Unicode"),
    ],
)
def test_malformed_inputs_are_invalid_input_naming_the_field(raw, match):
    rejects(raw, match)


def test_limits_bound_sizes():
    rejects({"prompt": "a", "max_tokens": 101}, "MAX_NEW_TOKENS")
    rejects({"prompt": "x" * 51}, "MAX_PROMPT_CHARS")
    rejects({"messages": [{"role": "user", "content": "x" * 30}] * 2}, "MAX_PROMPT_CHARS")
    rejects({"prompt": "a", "candidates": [" b"] * 4}, "MAX_CANDIDATES")
    rejects({"prompt": "a", "candidates": [" " + "b" * 50]}, "candidates.0 has 51 characters")
    rejects({"openai_route": CHAT, "openai_input": {"messages": [{"role": "user", "content": "a"}],
                                                    "max_completion_tokens": 101}}, "MAX_NEW_TOKENS")  # fmt: skip
    assert parse({"prompt": "x" * 50, "max_tokens": 100}).max_tokens == 100


def test_limits_come_from_the_environment():
    env = {"MAX_NEW_TOKENS": "7", "MAX_CANDIDATES": " 9 ", "MAX_PROMPT_CHARS": ""}
    assert jobs.Limits.from_env(env) == jobs.Limits(max_new_tokens=7, max_candidates=9)
    for bad in ("0", "-3", "1.5", "many"):  # the one error kind of every bad setting (as MAX_SEQ_LEN's)
        with pytest.raises(InvalidInput, match="environment variable MAX_NEW_TOKENS"):
            jobs.Limits.from_env({"MAX_NEW_TOKENS": bad})


def test_openai_fields_are_accepted_at_their_neutral_values_only():
    base = {"messages": [{"role": "user", "content": "a"}]}
    ok = {"model": "anything", "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {},
          "logprobs": False, "user": "u", "response_format": {"type": "text"}, "stop": "x", "seed": 3,
          "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5}  # fmt: skip
    req = parse({"openai_route": CHAT, "openai_input": {**base, **ok}})
    assert req.stops == ["x"] and req.include_usage and req.requested_max_tokens == 5
    assert req.sampling(5) == dict(max_tokens=5, temperature=1.0, top_k=0, top_p=1.0, seed=3, stop=["x"])
    for field, value, match in [
        ("n", 2, "n=2 is not supported"),
        ("presence_penalty", 0.5, "presence_penalty=0.5 is not supported"),
        ("top_logprobs", 2, "top_logprobs needs logprobs: true"),
        ("top_logprobs", 21, "less than or equal to 20"),
        ("tools", [], "tools: Extra inputs are not permitted"),
        ("temperature", 2.5, "temperature"),
        ("stream_options", {"include_usage": True}, "only allowed with stream: true"),
        ("response_format", {"type": "json_schema"}, "json_schema is required"),
        ("response_format", {"type": "xml"}, "response_format.type"),
    ]:
        with pytest.raises(InvalidInput, match=match):
            parse({"openai_route": CHAT, "openai_input": {**base, field: value}})
    rejects({"openai_route": "/v1/completions", "openai_input": {"prompt": "a", "echo": True}}, "echo=True")
    rejects({"openai_route": "/v1/completions", "openai_input": {"prompt": ["a", "b"]}}, "at most 1 item")
    rejects({"openai_route": "/v1/embeddings", "openai_input": {}}, "openai_route")
    rejects({"openai_route": "/v1/models", "openai_input": {"x": 1}}, "openai_input.x: Extra inputs")
    rejects({"openai_route": CHAT, "openai_input": {"messages": "hi"}}, r"openai_input\.messages")
    rejects({"openai_route": CHAT, "openai_input": {}, "extra": 1}, "extra: Extra inputs")


def test_error_messages_are_short_and_do_not_echo_the_input():
    with pytest.raises(InvalidInput) as e:
        parse({f"k{i}": "SECRET" * 8 for i in range(20)})
    assert "SECRET" not in str(e.value) and "(and 15 more)" in str(e.value) and len(str(e.value)) < 400
