"""One module per architecture family: `dense` (every layer full attention, dense or MoE FFN), `hybrid` (Gated
DeltaNet + gated attention), `mla` (DeepSeek's multi-head latent attention), each with a `<name>_cuda` sibling where
the CUDA backend runs it. Which module serves which architecture is engine/archs.py's table."""

from __future__ import annotations

from types import ModuleType

from engine import archs


def family(arch: str) -> ModuleType:
    """The NumPy family module of `arch` (imports the NumPy backend)."""
    import importlib

    return importlib.import_module(f"engine.models.{archs.get(arch).numpy_module}")
