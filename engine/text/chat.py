"""Chat messages -> prompt text, through the model's own chat template (GGUF `tokenizer.chat_template`).

The template is Jinja and is rendered the way Hugging Face's `apply_chat_template` renders it, which is what the
templates shipped in GGUF files are written against:
- an `ImmutableSandboxedEnvironment` (a template can read its data but not call methods that change it, nor reach
  Python internals), `trim_blocks` and `lstrip_blocks`, the loop-controls extension (`{% break %}`/`{% continue %}`);
  here bounded in size, steps and time (engine/text/sandbox.py): the template is the model file's code;
- globals `raise_exception(msg)` and `strftime_now(fmt)`, and a `tojson` filter that keeps non-ASCII text and does
  not HTML-escape (Jinja's own would turn `<` into `\\u003c` inside a prompt);
- variables `messages`, `bos_token`, `eos_token`, `add_generation_prompt`, plus any extra the caller passes (e.g.
  Qwen3's `enable_thinking`).

A model without a template gets ChatML, as llama.cpp does:
    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n
jinja2 is imported on first use: rendering is not on the cold path.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from engine.errors import InvalidInput, TokenizerError

# Names a caller's extra variables may not take: the engine's own variables and globals, Jinja's globals, and the
# parameter names of render() / Template.render(), which would collide as keyword arguments.
RESERVED = frozenset({"messages", "bos_token", "eos_token", "add_generation_prompt", "raise_exception",
                      "strftime_now", "range", "dict", "cycler", "joiner", "namespace", "lipsum", "self",
                      "template"})  # fmt: skip
MAX_STRFTIME_FORMAT = 256


class _TemplateRaised(Exception):
    """`raise_exception(...)` was called by the template: the conversation is one it refuses."""


def _raise_exception(message: str):
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > MAX_STRFTIME_FORMAT:
        raise TypeError(f"strftime_now takes a format string of at most {MAX_STRFTIME_FORMAT} characters")
    return datetime.now().strftime(fmt)


def _compile(source: str):
    """The compiled template, or the TokenizerError of a broken or unsafe one."""
    compiled = _compiled(source)
    if isinstance(compiled, TokenizerError):
        raise TokenizerError(str(compiled))
    return compiled


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    """One per distinct source (a worker serves one model, so this compiles once), a failure included: compiling
    a hostile template may take the sandbox's whole time limit, which is paid once, not by every chat job."""
    import jinja2

    from engine.text import sandbox

    env = sandbox.BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return sandbox.compile_template(env, source)
    except sandbox.TemplateLimit as e:
        return TokenizerError(f"the model's chat template was stopped: {e}")
    except jinja2.TemplateError as e:
        return TokenizerError(f"the model's chat template does not compile: {e}")
    except RecursionError:
        return TokenizerError("the model's chat template is nested too deeply to compile")


def chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The fallback format for a model whose GGUF has no `tokenizer.chat_template`."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def render(template: str | None, messages: Sequence[Mapping[str, Any]], bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, **extra: Any) -> str:  # fmt: skip
    """The prompt text for `messages` (each a mapping with at least `role` and a string `content`).

    Raises InvalidInput when the template refuses the conversation (its `raise_exception`, or an error while
    rendering these messages) and TokenizerError when the template itself is broken or unsafe.
    """
    clash = RESERVED.intersection(extra)
    if clash:
        raise InvalidInput(f"chat template variables {sorted(clash)} are set by the engine and cannot be passed")
    if not template:
        return chatml(messages, add_generation_prompt)
    compiled = _compile(template)
    from jinja2.exceptions import SecurityError

    from engine.text import sandbox

    variables = dict(messages=[dict(m) for m in messages], bos_token=bos_token, eos_token=eos_token,
                     add_generation_prompt=add_generation_prompt, **extra)  # fmt: skip
    try:
        return sandbox.render(compiled, variables)
    except sandbox.TemplateLimit as e:
        raise TokenizerError(f"the model's chat template was stopped: {e}") from None
    except _TemplateRaised as e:
        raise InvalidInput(f"the chat template refused these messages: {e}") from None
    except SecurityError as e:
        raise TokenizerError(f"the model's chat template tried an unsafe operation: {e}") from None
    except RecursionError:
        raise TokenizerError("the model's chat template recursed too deeply") from None
    except Exception as e:  # a template error that these particular messages provoke
        raise InvalidInput(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
