"""Job input schemas (docs/design.md §4), validated with pydantic at the worker's boundary.

`parse(raw, limits)` turns a job's `input` into one of: `System1Job`, `GenerateJob`, `ChatCompletionRequest`,
`CompletionRequest`, `ModelsRequest` — or raises `InvalidInput` naming the offending fields. Every model rejects
unknown fields and does no type coercion (JSON `"5"` is not 5, `true` is not 1); sizes are bounded by `Limits`
(engine/worker/limits.py, from the environment). The OpenAI request models accept the OpenAI fields this engine does not
implement only at their neutral values (`n: 1`, `presence_penalty: 0`, ...), so ordinary client libraries work and
nothing is silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from engine.errors import InvalidInput
from engine.worker.limits import Limits

MAX_MESSAGES = 1024
MAX_STOPS = 16
MAX_STOP_CHARS = 512
MAX_TEMPLATE_KWARGS = 16
MAX_ERRORS_SHOWN = 5
SEED_LIMIT = 1 << 63


def _check_unicode(raw: Any) -> None:
    """JSON may carry lone surrogates ("\\ud800") that no tokenizer can take: refuse them up front, naming where."""
    stack = [((), raw)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in value.items())
            stack.extend(((*path, k), k) for k in value)
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                where = ".".join(str(p) for p in path) or "input"
                raise InvalidInput(f"invalid job input: {where}: text must be valid Unicode (lone surrogate)") from None


StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Scalar = bool | int | float | str | None
TemplateKwargs = Annotated[dict[str, Scalar], Field(max_length=MAX_TEMPLATE_KWARGS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


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
    content: str | list[TextPart] | None = None
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


Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]


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
    candidates: list[str] = Field(min_length=1)
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
    stop: list[StopText] = Field(default_factory=list, max_length=MAX_STOPS)
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


class ResponseFormat(_Strict):
    type: Literal["text"]


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
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

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
    neutral: ClassVar[dict[str, tuple]] = {**_OpenAIRequest.neutral, "logprobs": (None, False), "top_logprobs": (None,)}

    messages: Messages
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: TemplateKwargs | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _check_text(self, limits: Limits) -> None:
        _check_chars(sum(len(m.text) for m in self.messages), limits, "messages")


class CompletionRequest(_OpenAIRequest):
    route: ClassVar[str] = "/v1/completions"
    neutral: ClassVar[dict[str, tuple]] = {**_OpenAIRequest.neutral, "echo": (None, False), "suffix": (None,),
                                           "best_of": (None, 1), "logprobs": (None,)}  # fmt: skip

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

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


def describe(error: ValidationError, prefix: str = "") -> str:
    """A short, input-free summary of a ValidationError: `field.path: message; ...`."""
    parts = []
    for err in error.errors(include_url=False, include_context=False, include_input=False)[:MAX_ERRORS_SHOWN]:
        loc = ".".join(str(x) for x in (prefix, *err["loc"]) if x != "") or "input"
        parts.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    more = error.error_count() - MAX_ERRORS_SHOWN
    return "invalid job input: " + "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _validate(model: type[BaseModel], data: Any, limits: Limits, prefix: str = "") -> Any:
    try:
        return model.model_validate(data, context={"limits": limits})
    except ValidationError as e:
        raise InvalidInput(describe(e, prefix)) from None


def parse(raw: Any, limits: Limits | None = None) -> Job:
    """Validate a job's `input` and say what kind of job it is (by its fields, or `mode`, or `openai_route`)."""
    limits = limits or Limits()
    if not isinstance(raw, dict):
        raise InvalidInput(f"job input must be a JSON object, got {type(raw).__name__}")
    _check_unicode(raw)
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
