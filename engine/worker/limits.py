"""Per-request size bounds of the worker, from the environment (kept apart from the pydantic schemas in
engine/worker/jobs.py so that reading them costs no pydantic import on the cold path)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from engine.errors import env_int


@dataclass(frozen=True)
class Limits:
    """Per-request bounds. The context length itself is the engine's (MAX_SEQ_LEN, read by `Engine.load`)."""

    max_new_tokens: int = 2048  # MAX_NEW_TOKENS
    max_candidates: int = 64  # MAX_CANDIDATES
    max_prompt_chars: int = 65536  # MAX_PROMPT_CHARS: prompt, all message contents together, each candidate

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Limits:
        """A malformed setting is an `invalid_input` error naming the variable, as every setting's is."""
        return cls(**{f.name: env_int(f.name.upper(), f.default, minimum=1, env=env) for f in fields(cls)})
