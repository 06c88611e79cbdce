"""Per-request size bounds of the worker, from the environment (kept apart from the pydantic schemas in
engine/worker/jobs.py so that reading them costs no pydantic import on the cold path)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from engine.errors import EngineError


@dataclass(frozen=True)
class Limits:
    """Per-request bounds. The context length itself is the engine's (MAX_SEQ_LEN, read by `Engine.load`)."""

    max_new_tokens: int = 2048  # MAX_NEW_TOKENS
    max_candidates: int = 64  # MAX_CANDIDATES
    max_prompt_chars: int = 65536  # MAX_PROMPT_CHARS: prompt, all message contents together, each candidate

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Limits:
        values = {}
        for f in fields(cls):
            var = f.name.upper()
            raw = env.get(var, "").strip()
            if not raw:
                continue
            if not raw.isdigit() or int(raw) < 1:
                raise EngineError(f"{var} must be a positive integer, got {raw!r}")
            values[f.name] = int(raw)
        return cls(**values)
