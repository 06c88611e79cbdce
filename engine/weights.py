"""Which tensors a model needs, by their GGUF names, and their validation against the file.

A family module lists `TensorSpec`s (name, expected GGUF `ne`, required or not); `resolve` checks each one against
the file's tensor table and returns the infos, so the backends never meet a missing or misshapen tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from engine.errors import GGUFError, UnsupportedArchitecture
from engine.gguf import GGUFFile, TensorInfo
from engine.quants import SUPPORTED_TYPES


@dataclass(frozen=True)
class TensorSpec:
    name: str  # full GGUF tensor name, e.g. "blk.3.attn_q.weight"
    ne: tuple[int, ...]  # expected GGUF ne (ne[0] contiguous)
    required: bool = True


def resolve(gf: GGUFFile, specs: Iterable[TensorSpec]) -> dict[str, TensorInfo]:
    """name -> TensorInfo for every spec present in the file; raises on a missing, misshapen or unsupported one."""
    found: dict[str, TensorInfo] = {}
    for spec in specs:
        info = gf.tensors.get(spec.name)
        if info is None:
            if spec.required:
                raise GGUFError(f"tensor '{spec.name}' is missing from {gf.path}")
            continue
        if info.ne != spec.ne:
            raise GGUFError(f"tensor '{spec.name}' has shape (ne) {list(info.ne)}, expected {list(spec.ne)}")
        if info.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedArchitecture(f"tensor '{spec.name}' has type {info.ggml_type.name}, not supported yet")
        found[spec.name] = info
    return found


V = TypeVar("V")


def group_by_layer(tensors: Mapping[str, V], n_layers: int) -> tuple[dict[str, V], list[dict[str, V]]]:
    """Split resolved tensors (full GGUF name -> anything) into the model-level ones, keyed by the name without
    ".weight" ("token_embd", "output_norm", "rope_freqs"), and one dict per layer keyed by the name within the
    block ("attn_q", "ffn_down_exps", "ssm_a", "ssm_dt" for blk.N.ssm_dt.bias). Both backends load through this."""
    top: dict[str, V] = {}
    layers: list[dict[str, V]] = [{} for _ in range(n_layers)]
    for name, value in tensors.items():
        if name.startswith("blk."):
            _, i, short = name.split(".")[:3]
            layers[int(i)][short] = value
        else:
            top[name.removesuffix(".weight")] = value
    return top, layers


def quant_mix(gf: GGUFFile) -> dict[str, int]:
    """Tensor type name -> count, the "quant mix" reported with every result."""
    mix: dict[str, int] = {}
    for info in gf.tensors.values():
        mix[info.ggml_type.name] = mix.get(info.ggml_type.name, 0) + 1
    return dict(sorted(mix.items(), key=lambda kv: -kv[1]))
