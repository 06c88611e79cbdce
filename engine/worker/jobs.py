"""Job input schemas (docs/design.md §4), validated with pydantic at the worker's boundary.

`parse(raw, limits)` turns a job's `input` into one of: `System1Job`, `GenerateJob`, `ChatCompletionRequest`,
`CompletionRequest`, `ModelsRequest` — or raises `InvalidInput` naming the offending fields. Every model rejects
unknown fields and does no type coercion (JSON `"5"` is not 5, `true` is not 1); sizes are bounded by `Limits`
(engine/worker/limits.py, from the environment). The OpenAI request models accept the OpenAI fields this engine
does not implement only at their neutral values (`n: 1`, `presence_penalty: 0`, ...), so ordinary client libraries
work and nothing is silently ignored.

A model's validator is built on its first use, or earlier by `build`: a cold worker builds the system1 job's before
its first job and the others once it is idle after it (handler.py, engine/worker/serverless.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from engine.errors import InvalidInput
from engine.text.chat import RESERVED
from engine.worker.limits import Limits
from engine.worker.stand_in import stand_in

MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 256  # text parts of one message
MAX_STOPS = 16
MAX_STOP_CHARS = 512
MAX_TEMPLATE_KWARGS = 16
MAX_ERRORS_SHOWN = 5
SEED_LIMIT = 1 << 63
# Shape bounds checked before pydantic (see _check_shape): generous for any real job, small enough that rejecting
# the worst job they allow costs milliseconds.
MAX_NODES = 1 << 16  # values (of any type) in one job
MAX_KEYS = 1024  # keys of one object (a JSON schema's properties, a logit_bias)
MAX_KEY_CHARS = 128
MAX_DEPTH = 64  # nesting (messages: 6 levels; a response_format's JSON schema goes deeper)
MAX_ITEMS = 4096  # items of a list without a limit of its own (candidates, messages, content, stop have theirs)


def _check_shape(raw: Any, limits: Limits) -> None:
    """Bound the job's shape before pydantic sees it, naming where a bound is crossed.

    pydantic validates element by element and records one error per bad element, so a wrong-typed list of millions
    costs seconds and gigabytes; here every list and object is checked by its length first (O(1)), and the whole
    walk stops at MAX_NODES values. Strings are bounded by MAX_PROMPT_CHARS each (no field may hold more) and must
    be valid Unicode: JSON may carry lone surrogates ("\\ud800") that no tokenizer can take.
    """
    named = {"candidates": (limits.max_candidates, " (MAX_CANDIDATES)"), "messages": (MAX_MESSAGES, ""),
             "content": (MAX_CONTENT_PARTS, ""), "stop": (MAX_STOPS, "")}  # fmt: skip
    any_list = max(MAX_ITEMS, limits.max_candidates)
    stack: list[tuple[tuple, Any]] = [((), raw)]
    seen = 0
    while stack:
        path, value = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise InvalidInput(f"invalid job input: more than {MAX_NODES} values in one job")
        if len(path) > MAX_DEPTH:
            raise InvalidInput(f"invalid job input: {_where(path)}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            if len(value) > MAX_KEYS:
                raise InvalidInput(f"invalid job input: {_where(path)}: {len(value)} keys; at most {MAX_KEYS}")
            for k, v in value.items():
                if isinstance(k, str):
                    _check_text(k, path, MAX_KEY_CHARS, " (object key)")
                stack.append(((*path, k), v))
        elif isinstance(value, list):
            limit, var = named.get(path[-1], (any_list, "")) if path else (any_list, "")
            if len(value) > limit:
                raise InvalidInput(f"invalid job input: {_where(path)}: {len(value)} items; the limit{var} is {limit}")
            stack.extend(((*path, i), v) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path, limits.max_prompt_chars, " (MAX_PROMPT_CHARS)")


def _where(path: tuple) -> str:
    return ".".join(str(p)[:MAX_KEY_CHARS] for p in path) or "input"


def _check_text(text: str, path: tuple, limit: int, var: str) -> None:
    if len(text) > limit:
        raise InvalidInput(f"invalid job input: {_where(path)} has {len(text)} characters; the limit{var} is {limit}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"invalid job input: {_where(path)}: text must be valid Unicode (lone surrogate)") from None


def _no_reserved(kwargs: dict[str, Any]) -> dict[str, Any]:
    clash = RESERVED.intersection(kwargs)
    if clash:
        raise ValueError(f"{sorted(clash)} are set by the engine and cannot be passed")
    return kwargs


StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Scalar = bool | int | float | str | None
TemplateKwargs = Annotated[dict[str, Scalar], Field(max_length=MAX_TEMPLATE_KWARGS), AfterValidator(_no_reserved)]


class _Strict(BaseModel):
    # defer_build: no validator is built at import; `_validate` builds a model's on its first job (see `build`)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True, defer_build=True)


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


def _check_chars(n_chars: int, limits: Limits, what: str) -> None:
    if n_chars > limits.max_prompt_chars:
        raise ValueError(f"{what} has {n_chars} characters; the limit (MAX_PROMPT_CHARS) is {limits.max_prompt_chars}")


def _check_new_tokens(max_tokens: int | None, limits: Limits) -> None:
    if max_tokens is not None and max_tokens > limits.max_new_tokens:  # an explicit request over the limit
        raise ValueError(f"max_tokens {max_tokens} is over the limit (MAX_NEW_TOKENS) of {limits.max_new_tokens}")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS, fail_fast=True)] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """Content as one string (text parts joined by newlines; no content is "")."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        out = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        return out


# fail_fast on every typed list: one error for a list of wrong elements, not one per element (see _check_shape).
Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]


class _Conditioned(_Strict):
    """A prompt, or chat messages rendered with the model's template: exactly one of the two."""

    prompt: str | None = None
    messages: Messages | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    def _check_source(self, limits: Limits) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be given")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs applies to messages only")
        if self.prompt is not None:
            _check_chars(len(self.prompt), limits, "prompt")
        else:
            _check_chars(sum(len(m.text) for m in self.messages), limits, "messages")


class System1Job(_Conditioned):
    mode: Literal["system1"] | None = None
    candidates: list[str] = Field(min_length=1, fail_fast=True)
    temperature: float = Field(1.0, gt=0.0)

    @model_validator(mode="after")
    def _bounded(self, info: ValidationInfo) -> System1Job:
        limits = _limits(info)
        self._check_source(limits)
        if len(self.candidates) > limits.max_candidates:
            n, limit = len(self.candidates), limits.max_candidates
            raise ValueError(f"{n} candidates; the limit (MAX_CANDIDATES) is {limit}")
        for i, c in enumerate(self.candidates):
            _check_chars(len(c), limits, f"candidate {i}")
        return self


class GenerateJob(_Conditioned):
    mode: Literal["generate"] | None = None
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: list[StopText] = Field(default_factory=list, max_length=MAX_STOPS, fail_fast=True)
    stream: bool = False

    @model_validator(mode="after")
    def _bounded(self, info: ValidationInfo) -> GenerateJob:
        limits = _limits(info)
        self._check_source(limits)
        _check_new_tokens(self.max_tokens if "max_tokens" in self.model_fields_set else None, limits)
        return self

    def sampling(self, limits: Limits) -> dict:
        """Engine arguments; an unset max_tokens is the default (64) capped at MAX_NEW_TOKENS."""
        max_tokens = self.max_tokens if "max_tokens" in self.model_fields_set else min(64, limits.max_new_tokens)
        return dict(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    seed=self.seed, stop=list(self.stop))  # fmt: skip


class StreamOptions(_Strict):
    include_usage: bool = False


MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat; completions allow 5 there, vLLM 20 for both


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # checked by engine/worker/structured.py
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema (constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class _OpenAIRequest(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions. Defaults are OpenAI's (temperature 1)."""

    route: ClassVar[str]
    # field -> the values accepted for an OpenAI feature this engine does not implement
    neutral: ClassVar[dict[str, tuple]] = {
        "n": (None, 1),
        "presence_penalty": (None, 0),
        "frequency_penalty": (None, 0),
        "logit_bias": (None, {}),
    }

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # not OpenAI's; llama.cpp's and vLLM's servers take it too
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS, fail_fast=True)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # a Lark or GBNF grammar for the output (llama.cpp's and vLLM's servers take one)

    @model_validator(mode="after")
    def _supported(self, info: ValidationInfo) -> _OpenAIRequest:
        for name, allowed in self.neutral.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported (only {allowed[-1]!r})")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        limits = _limits(info)
        _check_new_tokens(self.requested_max_tokens, limits)
        self._check_text(limits)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int) -> dict:
        return dict(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                    top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                    stop=self.stops)  # fmt: skip

    def _check_text(self, limits: Limits) -> None:
        raise NotImplementedError


class ChatCompletionRequest(_OpenAIRequest):
    route: ClassVar[str] = "/v1/chat/completions"

    messages: Messages
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: TemplateKwargs | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def n_logprobs(self) -> int | None:
        """Alternatives per token when logprobs are asked for (0: the chosen token's only), else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _check_text(self, limits: Limits) -> None:
        _check_chars(sum(len(m.text) for m in self.messages), limits, "messages")


class CompletionRequest(_OpenAIRequest):
    route: ClassVar[str] = "/v1/completions"
    neutral: ClassVar[dict[str, tuple]] = {**_OpenAIRequest.neutral, "echo": (None, False), "suffix": (None,),
                                           "best_of": (None, 1)}  # fmt: skip

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1, fail_fast=True)]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def n_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def _check_text(self, limits: Limits) -> None:
        _check_chars(len(self.text), limits, "prompt")


class ModelsRequest(_Strict):
    route: ClassVar[str] = "/v1/models"


class _OpenAIJob(_Strict):
    openai_route: Literal["/v1/chat/completions", "/v1/completions", "/v1/models"]
    openai_input: dict[str, Any] | None = None


Job = System1Job | GenerateJob | ChatCompletionRequest | CompletionRequest | ModelsRequest
_OPENAI_MODELS = {m.route: m for m in (ChatCompletionRequest, CompletionRequest, ModelsRequest)}
MODELS = (System1Job, GenerateJob, _OpenAIJob, ChatCompletionRequest, CompletionRequest, ModelsRequest)
_PLUGIN_LOADER = "pydantic.plugin._loader"
_building = threading.Lock()  # one build at a time: _no_plugin_search's stand-in is in sys.modules while it runs


def build(models: Iterable[type[BaseModel]] = MODELS) -> None:
    """Build the validators of `models` not built yet, so that their first parse does not. On a 2-core machine
    (2026-12-01) all of MODELS took ~20 ms at import; System1Job alone, the first build, ~1.3 ms (8 ms with the
    plugin search, see _no_plugin_search)."""
    with _building, _no_plugin_search():
        for model in models:
            if not model.__pydantic_complete__:
                model.model_rebuild(_parent_namespace_depth=0)  # the module's names are all its annotations use


def build_system1() -> None:
    """The validator a system1 job needs (a cold worker builds it before its first job)."""
    build((System1Job,))


def _no_plugin_search():
    """pydantic's plugin loader, imported at the first validator built, imports importlib.metadata (~6 ms: zipfile,
    csv, email) for an entry-point search that it skips when PYDANTIC_DISABLE_PLUGINS disables every plugin (the
    worker's setting). Then a stand-in whose `get_plugins` answers the same `()` serves the builds."""
    if os.environ.get("PYDANTIC_DISABLE_PLUGINS") not in ("__all__", "1", "true"):
        return contextlib.nullcontext()
    return stand_in(_PLUGIN_LOADER, get_plugins=lambda: ())


def describe(error: ValidationError, prefix: str = "") -> str:
    """A short, input-free summary of a ValidationError: `field.path: message; ...`."""
    parts = []
    for err in error.errors(include_url=False, include_context=False, include_input=False)[:MAX_ERRORS_SHOWN]:
        loc = ".".join(str(x) for x in (prefix, *err["loc"]) if x != "") or "input"
        parts.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    more = error.error_count() - MAX_ERRORS_SHOWN
    return "invalid job input: " + "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _validate(model: type[BaseModel], data: Any, limits: Limits, prefix: str = "") -> Any:
    if not model.__pydantic_complete__:
        build((model,))
    try:
        return model.model_validate(data, context={"limits": limits})
    except ValidationError as e:
        raise InvalidInput(describe(e, prefix)) from None


def parse(raw: Any, limits: Limits | None = None) -> Job:
    """Validate a job's `input` and say what kind of job it is (by its fields, or `mode`, or `openai_route`)."""
    limits = limits or Limits()
    if not isinstance(raw, dict):
        raise InvalidInput(f"job input must be a JSON object, got {type(raw).__name__}")
    _check_shape(raw, limits)
    if "openai_route" in raw:
        job = _validate(_OpenAIJob, raw, limits)
        model = _OPENAI_MODELS[job.openai_route]
        return _validate(model, job.openai_input or {}, limits, "openai_input")
    mode = raw.get("mode")
    if mode is not None and mode not in ("system1", "generate"):
        raise InvalidInput(f"mode must be 'system1' or 'generate', got {mode!r}")
    if mode == "system1" or (mode is None and "candidates" in raw):
        return _validate(System1Job, raw, limits)
    return _validate(GenerateJob, raw, limits)
