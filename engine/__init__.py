"""Reflex engine: GGUF in, system1 scores or generated tokens out, with the cold start accounted for.

`engine.Engine` is imported lazily so that `import engine.gguf` (and the cold path) pays only for what it uses.
"""

from __future__ import annotations

__all__ = ["Engine", "default_model_path"]


def __getattr__(name: str):
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name == "default_model_path":
        from engine.bundled import default_model_path

        return default_model_path
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
