"""A stand-in module for the length of a block: an import that would cost the cold path more than its one use needs
(serverless.py: py-cpuinfo while the SDK imports; jobs.py: pydantic's plugin loader while validators build)."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator


@contextlib.contextmanager
def stand_in(name: str, **attrs) -> Iterator[None]:
    """Module `name` is a stand-in with `attrs` while the block runs, unless the real one is imported already;
    afterwards it is gone again, so any later import gets the real module."""
    if name in sys.modules:
        yield
        return
    stub = types.ModuleType(name)
    stub.__dict__.update(attrs)
    sys.modules[name] = stub
    try:
        yield
    finally:
        if sys.modules.get(name) is stub:
            del sys.modules[name]
