"""The K/V cache's element type, `KV_CACHE_TYPE`: "f32" (the default) or "f16".

f16 halves the cache's memory and the bytes each decode step's attention reads, which is what a long context costs;
the arithmetic stays float32 (values are widened as they are loaded). Keys and values are rounded to nearest even
when they are written, on both backends, so a state file moves between them. f32 stays the default: the rounding
moves the fixtures' logits by up to 1.7e-3 (CPU and CUDA alike, 2026-12-03), past the F32 files' bound of 1e-4,
though far inside the quantized files' (docs/design.md §7; llama.cpp's own cache is f16 by default)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from engine.errors import InvalidInput

DTYPES = {"f32": "f4", "f16": "f2"}  # name -> element code (engine/cuda/memory.DeviceArray and NumPy dtype strings)
NAMES = {code: name for name, code in DTYPES.items()}
DEFAULT = "f32"


def resolve(value: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The cache type's name: `value` when given, else KV_CACHE_TYPE, else f32; anything else is an invalid_input
    error naming where it came from."""
    where = "kv_cache_type"
    if value is None:
        value = (os.environ if env is None else env).get("KV_CACHE_TYPE", "")
        where = "environment variable KV_CACHE_TYPE"
    name = value.strip().lower()
    if not name:
        return DEFAULT
    if name not in DTYPES:
        raise InvalidInput(f"{where}={value!r}: the K/V cache type is one of {', '.join(DTYPES)}")
    return name


def layout(family: str, dtype: str) -> str:
    """A state file's cache layout name (engine/state.py): e.g. "kv-f16/1" for K/V rows of f16."""
    return f"{family}-{NAMES[dtype]}/1"
