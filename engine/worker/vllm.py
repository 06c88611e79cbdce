"""worker-vllm compatibility: its environment names and its native job shape, so an endpoint can swap images.

Environment (each alias only where the worker's own name is unset; a malformed value is an `invalid_input` error
naming the variable, as every setting's is):
    MAX_MODEL_LEN                        -> MAX_SEQ_LEN (positions per request)
    OPENAI_SERVED_MODEL_NAME_OVERRIDE    -> SERVED_MODEL_NAME (`model` of OpenAI answers and /v1/models)
    CUSTOM_CHAT_TEMPLATE                 a Jinja chat template used instead of the GGUF's
    DEFAULT_BATCH_SIZE                   largest streamed batch, tokens (ours: 48)
    DEFAULT_MIN_BATCH_SIZE               first streamed batch (1)
    DEFAULT_BATCH_SIZE_GROWTH_FACTOR     growth between batches (3)
    (MIN_BATCH_SIZE, BATCH_SIZE_GROWTH_FACTOR: the names worker-vllm's engine also reads)
    KV_CACHE_DTYPE                       -> KV_CACHE_TYPE: "auto" keeps the default (f32); "fp16" / "float16" /
                                            "half" and vLLM's fp8 kinds give the f16 cache, the smallest this engine
                                            has (a log line says so for fp8)

Native job (worker-vllm's handler before its OpenAI proxy design):
    {"prompt": str | "messages": [...], "sampling_params": {...vLLM SamplingParams...}, "stream": bool,
     "apply_chat_template": bool, "max_batch_size", "min_batch_size", "batch_size_growth_factor"}
answered as worker-vllm answers: batches `{"choices": [{"tokens": [text, ...]}], "usage": {"input", "output"}}`
(streamed: one per batch of tokens; not streamed: one, with the whole text as its one token string). A job is
taken for this shape when it has a key only worker-vllm's shape has (`sampling_params`, `apply_chat_template`,
the batch sizes, `use_openai_format`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from engine import cache_type
from engine.errors import InvalidInput, env_int

log = logging.getLogger(__name__)

VLLM_ONLY_KEYS = frozenset({"sampling_params", "apply_chat_template", "use_openai_format", "max_batch_size",
                            "min_batch_size", "batch_size_growth_factor"})  # fmt: skip
DEFAULT_MAX_TOKENS = 100  # worker-vllm's (vLLM's own 16 cut answers short: its issues #58, #74)


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int | None, minimum: int) -> int | None:
    for name in names:
        if (env.get(name) or "").strip():
            return env_int(name, 0, minimum=minimum, env=env)
    return default


@dataclass(frozen=True)
class Settings:
    """Worker settings read once at load (the engine's and limits' own variables are read where they are used)."""

    max_seq_len: int | None = None  # None: the engine reads MAX_SEQ_LEN itself
    served_name: str | None = None
    chat_template: str | None = None
    stream_first: int = 1
    stream_growth: int = 3
    stream_largest: int = 48
    kv_cache_type: str | None = None  # None: the engine reads KV_CACHE_TYPE itself

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        max_seq = None if (env.get("MAX_SEQ_LEN") or "").strip() else _first_int(env, ("MAX_MODEL_LEN",), None, 1)
        served = (env.get("SERVED_MODEL_NAME") or env.get("OPENAI_SERVED_MODEL_NAME_OVERRIDE") or "").strip()
        template = env.get("CUSTOM_CHAT_TEMPLATE") or None
        if template is not None and len(template) > 1 << 20:
            raise InvalidInput("environment variable CUSTOM_CHAT_TEMPLATE is longer than 1 MiB")
        largest = _first_int(env, ("DEFAULT_BATCH_SIZE",), 48, 1)
        first = _first_int(env, ("DEFAULT_MIN_BATCH_SIZE", "MIN_BATCH_SIZE"), 1, 1)
        growth = _first_int(env, ("DEFAULT_BATCH_SIZE_GROWTH_FACTOR", "BATCH_SIZE_GROWTH_FACTOR"), 3, 1)
        return cls(max_seq, served or None, template, min(first, largest), growth, largest, _kv_cache_type(env))


_VLLM_KV = {"auto": None, "fp16": "f16", "float16": "f16", "half": "f16", "fp8": "f16", "fp8_e4m3": "f16",
            "fp8_e5m2": "f16", "fp8_inc": "f16"}  # fmt: skip


def _kv_cache_type(env: Mapping[str, str]) -> str | None:
    """KV_CACHE_TYPE (checked here, so a bad one fails at boot), else worker-vllm's KV_CACHE_DTYPE mapped."""
    if (env.get("KV_CACHE_TYPE") or "").strip():
        return cache_type.resolve(None, env)
    raw = (env.get("KV_CACHE_DTYPE") or "").strip()
    if not raw:
        return None
    if raw.lower() not in _VLLM_KV:
        raise InvalidInput(f"environment variable KV_CACHE_DTYPE={raw!r}: one of {', '.join(_VLLM_KV)}")
    chosen = _VLLM_KV[raw.lower()]
    if raw.lower().startswith("fp8"):
        log.warning("KV_CACHE_DTYPE=%s: this engine's smallest K/V cache is f16; using it", raw)
    return chosen


def is_vllm_job(raw: object) -> bool:
    return isinstance(raw, dict) and not VLLM_ONLY_KEYS.isdisjoint(raw)


def batch_output(texts: list[str], prompt_tokens: int, completion_tokens: int) -> dict:
    """worker-vllm's native output object for one batch of token texts (n is always 1 here)."""
    return {"choices": [{"tokens": texts}], "usage": {"input": prompt_tokens, "output": completion_tokens}}
