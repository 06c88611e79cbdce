"""Typed errors. Every failure that reaches a caller is an EngineError whose `kind` is one of docs/design.md §4's
kinds."""

from __future__ import annotations

import os
from collections.abc import Mapping


class EngineError(Exception):
    """Base class; `kind` is the machine-readable category reported as `error_kind`."""

    kind = "internal"


class GGUFError(EngineError):
    """The file is not a well-formed GGUF (bad magic, truncated, absurd counts, ...)."""

    kind = "gguf"


class NonFiniteLogits(GGUFError):
    """The model computed NaN or infinite logits: its weights (or what they overflow to) are broken, which is the
    model file's fault, never the request's."""

    def __init__(self, what: str = "logits"):
        super().__init__(f"the model's {what} are not finite (NaN or infinity): its weights are broken")


def naming_file(error: EngineError, path: str) -> EngineError:
    """`error` (same object, same type) with its message prefixed by the model file's path, unless it names it."""
    message = str(error)
    if path not in message:
        error.args = (f"{path}: {message}",)
    return error


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


def env_int(name: str, default: int, minimum: int = 0, env: Mapping[str, str] | None = None) -> int:
    """An integer setting from the environment (`env`, default os.environ); a malformed one is an `invalid_input`
    error naming the variable: every setting of the engine and the worker fails the same way."""
    raw = (os.environ if env is None else env).get(name)
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
