"""Chat templates: rendering as Hugging Face does, in a sandbox, with the ChatML fallback."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.errors import InvalidInput, TokenizerError
from engine.text import chat
from tests.worker_support import TINY

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b> é"}]


def test_chatml_fallback_when_the_model_has_no_template():
    assert chat.render(None, MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi <b>there</b> é<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chat.render("", MESSAGES, add_generation_prompt=False).endswith("é<|im_end|>\n")


def test_variables_whitespace_control_and_loop_controls():
    template = (
        "{{ bos_token }}\n{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "[{{ m.role }}] {{ m.content }}\n  {% endfor %}\n{% if add_generation_prompt %}>{% endif %}{{ eos_token }}"
    )
    out = chat.render(template, MESSAGES, bos_token="<s>", eos_token="</s>")
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one
    assert out == "<s>\n[system] Be brief.\n></s>"


def test_tojson_keeps_text_as_is_and_extra_variables_reach_the_template():
    template = "{{ messages[1].content | tojson }}{% if enable_thinking is defined and not enable_thinking %}!{% endif"
    template += " %}"
    assert chat.render(template, MESSAGES, enable_thinking=False) == '"Hi <b>there</b> é"!'
    assert chat.render(template, MESSAGES) == '"Hi <b>there</b> é"'
    with pytest.raises(InvalidInput, match="set by the engine"):
        chat.render(template, MESSAGES, **{"raise_exception": None})


def test_raise_exception_is_an_invalid_input():
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}"
    template += "{% endif %}"
    with pytest.raises(InvalidInput, match="first message must be from the user"):
        chat.render(template, MESSAGES)


def test_the_sandbox_keeps_templates_away_from_python_internals_and_mutation():
    with pytest.raises(TokenizerError, match="unsafe"):
        chat.render("{{ ''.__class__.__mro__[1].__subclasses__() }}", MESSAGES)
    with pytest.raises(TokenizerError, match="unsafe"):
        chat.render("{{ messages.append(1) }}", MESSAGES)
    with pytest.raises(TokenizerError, match="does not compile"):
        chat.render("{% for %}", MESSAGES)


def test_engine_renders_its_gguf_template():
    engine = Engine.load(TINY, backend="cpu", max_seq_len=64)
    text = engine.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"  # Qwen3's template, thinking on
    text = engine.apply_chat_template([{"role": "user", "content": "Hello"}], enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the rendered special tokens are parsed as such: <|im_start|> is one token
    ids = engine.tokenizer.encode(text)
    assert ids[0] == engine.tokenizer.encode("<|im_start|>", add_bos=False)[0]
