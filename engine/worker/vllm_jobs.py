"""The schema of worker-vllm's native job (engine/worker/vllm.py describes the shape), validated as strictly as the
worker's own jobs (engine/worker/jobs.py): vLLM sampling parameters this engine does not implement are accepted only
at their neutral values, everything else unknown is refused."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationInfo, model_validator

from engine.errors import InvalidInput
from engine.worker import jobs
from engine.worker.limits import Limits
from engine.worker.vllm import DEFAULT_MAX_TOKENS


class SamplingParams(jobs._Strict):
    """vLLM's SamplingParams, the part that maps onto this engine (defaults are vLLM's: temperature 1)."""

    neutral: ClassVar[dict[str, tuple]] = {
        "n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
        "repetition_penalty": (None, 1), "min_p": (None, 0), "ignore_eos": (None, False), "min_tokens": (None, 0),
        "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
        "include_stop_str_in_output": (None, False), "detokenize": (None, True), "stop_token_ids": (None, []),
        "logprobs": (None,), "prompt_logprobs": (None,),
    }  # fmt: skip

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM) and 0 both mean: the whole vocabulary
    seed: int | None = Field(None, ge=0, lt=jobs.SEED_LIMIT)
    stop: jobs.StopText | Annotated[list[jobs.StopText], Field(max_length=jobs.MAX_STOPS)] | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    detokenize: bool | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> SamplingParams:
        for name, allowed in self.neutral.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported (only {allowed[-1]!r})")
        return self

    def engine_args(self, limits: Limits) -> dict:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_tokens or min(DEFAULT_MAX_TOKENS, limits.max_new_tokens)
        return dict(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                    top_k=max(0, self.top_k or 0), top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                    stop=stops)  # fmt: skip


class VllmJob(jobs._Strict):
    prompt: str | None = None
    messages: jobs.Messages | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    apply_chat_template: bool = False
    use_openai_format: bool | None = None
    max_batch_size: int | None = Field(None, ge=1, le=4096)
    min_batch_size: int | None = Field(None, ge=1, le=4096)
    batch_size_growth_factor: float | None = Field(None, ge=1.0, le=64.0)

    @model_validator(mode="after")
    def _bounded(self, info: ValidationInfo) -> VllmJob:
        limits = jobs._limits(info)
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be given")
        if self.use_openai_format:
            raise ValueError("use_openai_format is not supported: send openai_route / openai_input instead")
        if self.prompt is not None:
            jobs._check_chars(len(self.prompt), limits, "prompt")
        else:
            jobs._check_chars(sum(len(m.text) for m in self.messages), limits, "messages")
        jobs._check_new_tokens(self.sampling_params.max_tokens, limits)
        return self

    def chat(self) -> list[dict] | None:
        """The messages to render with the chat template, or None for a raw prompt (worker-vllm's rule: messages,
        or a prompt with apply_chat_template, which becomes one user message)."""
        if self.messages is not None:
            return [m.for_template() for m in self.messages]
        return [{"role": "user", "content": self.prompt}] if self.apply_chat_template else None

    def batch_sizes(self, first: int, growth: float, largest: int) -> tuple[int, float, int]:
        largest = self.max_batch_size or largest
        return min(self.min_batch_size or first, largest), self.batch_size_growth_factor or growth, largest


def parse(raw: Any, limits: Limits) -> VllmJob:
    if not isinstance(raw, dict):
        raise InvalidInput(f"job input must be a JSON object, got {type(raw).__name__}")
    jobs._check_shape(raw, limits)
    return jobs._validate(VllmJob, raw, limits)
