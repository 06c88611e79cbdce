"""Typed errors. Every failure that reaches a caller is an EngineError whose `kind` is one of docs/design.md §4's
kinds."""

from __future__ import annotations


class EngineError(Exception):
    """Base class; `kind` is the machine-readable category reported as `error_kind`."""

    kind = "internal"


class GGUFError(EngineError):
    """The file is not a well-formed GGUF (bad magic, truncated, absurd counts, ...)."""

    kind = "gguf"


class UnsupportedArchitecture(EngineError):
    """The architecture, a tensor type or a required feature of the model is not implemented."""

    kind = "unsupported_architecture"


class TokenizerError(EngineError):
    kind = "tokenizer"


class InvalidInput(EngineError):
    """The request itself is wrong (bad candidate, bad sampling parameter, ...)."""

    kind = "invalid_input"


class ContextOverflow(EngineError):
    """The request needs more positions than the context allows; raised before anything is allocated."""

    kind = "context_overflow"

    def __init__(self, needed: int, limit: int, what: str = "request"):
        super().__init__(f"context length exceeded: {what} needs {needed} positions, the limit is {limit}")
        self.needed = needed
        self.limit = limit


class CudaError(EngineError):
    kind = "cuda"


class OutOfMemory(EngineError):
    kind = "out_of_memory"


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer setting from the environment; a malformed one is an `invalid_input` error naming it."""
    import os

    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidInput(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise InvalidInput(f"environment variable {name}={value} must be at least {minimum}")
    return value


ERROR_KINDS = (
    "gguf",
    "unsupported_architecture",
    "cuda",
    "out_of_memory",
    "tokenizer",
    "context_overflow",
    "invalid_input",
    "internal",
)
