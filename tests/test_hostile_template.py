"""Hostile chat templates (the model file's code): each ends in a `tokenizer` error naming the limit it crossed,
within the sandbox's time and memory bounds (engine/text/sandbox.py), and the model keeps serving other jobs."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from engine.engine import Engine
from engine.errors import TokenizerError
from engine.text import chat, sandbox
from engine.worker.limits import Limits
from engine.worker.service import Worker
from tests.worker_support import TINY

MESSAGES = [{"role": "user", "content": "hello " * 100}]
ANY_LIMIT = r"MAX_\w+|recursed|sum' over sequences|indent over"
BOMBS = {
    "2e9 repeats": ("{{ 'a' * 2000000000 }}", "MAX_CHARS"),
    "repeat of a repeat": ("{{ 'a' * 1000000 * 1000000 }}", "MAX_CHARS"),
    "nested loops": ("{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}", "MAX_STEPS"),
    "nested loops over content": (
        "{% for a in messages[0].content %}{% for b in messages[0].content %}{% for c in "
        "messages[0].content %}{% endfor %}{% endfor %}{% endfor %}",
        "MAX_STEPS",
    ),
    "range over the limit": ("{% for i in range(100000000) %}{% endfor %}", "MAX_INT_ARG"),
    "doubling with ~": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "MAX_CHARS",
    ),
    "doubling with +": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "MAX_CHARS",
    ),
    "a shared list 64 deep, written": (
        "{% set ns = namespace(s=['ab']) %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s] %}{% endfor %}{{ ns.s }}",
        "MAX_CHARS",
    ),
    "the same list, in a namespace": (
        "{% set ns = namespace(s=['ab']) %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s] %}{% endfor %}"
        "{{ namespace(x=ns.s) }}",
        "MAX_CHARS",
    ),
    "the same list, as dict items": (
        "{% set ns = namespace(s=['ab']) %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s] %}{% endfor %}"
        "{{ dict(a=ns.s).items() }}",
        "MAX_CHARS",
    ),
    "doubling of markup": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s|safe ~ ns.s|safe %}{% endfor %}",
        "MAX_WORK|MAX_CHARS",
    ),
    "bytes kept in a list": (
        "{% set s = 'a' * 4000000 %}{% set ns = namespace(l=[]) %}{% for i in range(60000) %}"
        "{% set ns.l = ns.l + [s.encode()] %}{% endfor %}",
        "MAX_WORK",
    ),
    "replace amplification": ("{% set s = 'a' * 4000000 %}{{ s.replace('a', s) }}", "MAX_CHARS"),
    "replace filter amplification": ("{% set s = 'a' * 4000000 %}{{ s|replace('a', s) }}", "MAX_CHARS"),
    "%-format width": ("{{ '%2000000000s' % 'x' }}", "MAX_CHARS"),
    "format() width": ("{{ '{:>2000000000}'.format('x') }}", "MAX_CHARS"),
    "center() width": ("{{ 'x'.center(2000000000) }}", "MAX_INT_ARG"),
    "center filter, folded at compile time": ("{{ 'x'|center(2000000000) }}", "MAX_INT_ARG"),
    "expandtabs": ("{{ ('\t' * 60000).expandtabs(60000) }}", "MAX_CHARS"),
    "join of repeats": ("{{ ([('a' * 4000000)] * 60000)|join }}", "MAX_CHARS"),
    "str.join of repeats": ("{{ ''.join([('a' * 4000000)] * 60000) }}", "MAX_CHARS"),
    "indent": ("{{ ('\n' * 4000000)|indent(60000) }}", "MAX_CHARS"),
    "output in a loop": ("{% for i in range(60000) %}{{ 'a' * 4000000 }}{% endfor %}", "output is over"),
    "slices in a loop": (
        "{% set s = 'a' * 4000000 %}{% for i in range(60000) %}{% set t = s[1:] %}{% endfor %}",
        "MAX_WORK",
    ),
    "macro recursion": ("{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}", "recursed"),
    "quadratic sum": ("{{ range(60000)|batch(1)|sum(start=[]) }}", "sum' over sequences"),
    "slice filter count": ("{{ range(10)|slice(4000000)|list|length }}", "MAX_INT_ARG"),
    "wordwrap": ("{{ ('a ' * 2000000)|wordwrap(1) }}", "MAX_CHARS"),
    "tojson indent": ("{{ range(1000)|list|tojson(indent=60000) }}", "indent over"),
    "a long repr, repeated": ("{{ (range(60000)|list|string) * 100 }}", "MAX_CHARS"),
    "a huge source": ("{{ 'x' }}" * 10000, "MAX_SOURCE_CHARS"),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_hostile_template_is_a_tokenizer_error_naming_its_limit(name):
    template, limit = BOMBS[name]
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError, match=limit) as e:
        chat.render(template, MESSAGES)
    elapsed = time.perf_counter() - t0
    assert "chat template" in str(e.value)
    assert elapsed < sandbox.MAX_SECONDS + 1.0, elapsed
    chat._compiled.cache_clear()  # measure the compile too
    tracemalloc.start()
    try:
        with pytest.raises(TokenizerError, match=ANY_LIMIT):  # slower under tracemalloc: any limit may trip first
            chat.render(template, MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 << 20, peak


def test_the_wall_time_limit(monkeypatch):
    monkeypatch.setattr(sandbox, "MAX_SECONDS", 0.2)
    monkeypatch.setattr(sandbox, "MAX_STEPS", 1 << 40)
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError, match="MAX_SECONDS"):
        chat.render("{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}", MESSAGES)
    assert time.perf_counter() - t0 < 1.0
    slow_to_compile = "{% macro m() %}{{ a.b.c|upper ~ d[1:2] }}{% endmacro %}" * 1100  # 60 K: 0.15-1 s here
    monkeypatch.setattr(sandbox, "MAX_SECONDS", 0.01)  # compiling is bounded too, even on a fast idle machine
    with pytest.raises(TokenizerError, match="MAX_SECONDS"):
        chat.render(slow_to_compile, MESSAGES)
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError, match="MAX_SECONDS"):  # a failed compile is remembered, not retried
        chat.render(slow_to_compile, MESSAGES)
    assert time.perf_counter() - t0 < 0.1


def test_a_long_real_conversation_renders_as_unbounded_jinja_does():
    """1,024 messages (the job limit) through Qwen3's template: well inside every limit, and the same text."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    engine = Engine.load(TINY, backend="cpu", max_seq_len=64)
    template = engine.tokenizer.chat_template
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"<think>t{i}</think>turn {i} " * 3}
                for i in range(1024)]  # fmt: skip
    t0 = time.perf_counter()
    ours = chat.render(template, messages, enable_thinking=False)
    assert time.perf_counter() - t0 < sandbox.MAX_SECONDS / 2
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = chat._tojson
    env.globals.update(raise_exception=chat._raise_exception, strftime_now=chat._strftime_now)
    plain = env.from_string(template).render(messages=messages, bos_token="", eos_token="",
                                             add_generation_prompt=True, enable_thinking=False)  # fmt: skip
    assert ours == plain


def test_the_model_still_serves_other_jobs():
    engine = Engine.load(TINY, backend="cpu", max_seq_len=256)
    engine.tokenizer.chat_template = BOMBS["2e9 repeats"][0]
    worker = Worker(engine, Limits())

    def run(job):
        (out,) = [o for o in worker.run(job) if o is not None]
        return out

    hi = [{"role": "user", "content": "Hi"}]
    for job in ({"messages": hi}, {"messages": hi, "candidates": [" a", " b"]},
                {"openai_route": "/v1/chat/completions", "openai_input": {"messages": hi}}):  # fmt: skip
        out = run(job)
        message = out["error"]["message"] if isinstance(out.get("error"), dict) else out.get("error")  # OpenAI's shape
        assert out.get("error_kind") == "tokenizer" and "MAX_CHARS" in message, out
    assert "error" not in run({"prompt": "The capital of France is", "max_tokens": 3})
    assert "error" not in run({"prompt": "The capital of France is", "candidates": [" Paris", " Rome"]})
