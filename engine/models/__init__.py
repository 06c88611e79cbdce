"""One module per architecture family; `family(arch)` picks the module for a GGUF's `general.architecture`."""

from __future__ import annotations

from types import ModuleType

from engine.errors import UnsupportedArchitecture

# general.architecture -> module: "dense" (every layer full attention, dense or MoE FFN), "hybrid" (Gated
# DeltaNet + gated attention), "mla" (DeepSeek's multi-head latent attention).
_FAMILIES = {
    "qwen3": "dense",
    "llama": "dense",
    "qwen3moe": "dense",
    "qwen35": "hybrid",
    "qwen35moe": "hybrid",
    "qwen3next": "hybrid",
    "deepseek2": "mla",
}


def family_name(arch: str) -> str:
    """The family module's name; `engine.models.<name>` is its NumPy model, `<name>_cuda` its CUDA one."""
    name = _FAMILIES.get(arch)
    if name is None:
        raise UnsupportedArchitecture(f"architecture '{arch}' is not supported (supported: {', '.join(_FAMILIES)})")
    return name


def family(arch: str) -> ModuleType:
    """The NumPy family module (imports the NumPy backend)."""
    import importlib

    return importlib.import_module(f"engine.models.{family_name(arch)}")
