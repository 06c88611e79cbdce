"""LoRA adapters in llama.cpp's GGUF adapter format, opened and checked against a base model before any backend
allocates anything.

An adapter file has `general.type = "adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha` and the base's
`general.architecture`; for every adapted base tensor W (GGUF ne [in, out], or [in, out, n_expert] for an
expert stack) it holds `W.lora_a` (ne [in, rank] (+ [n_expert])) and `W.lora_b` (ne [rank, out] (+ [n_expert])).
Applied as llama.cpp does:  y = W·x + scale · B·(A·x),  scale = alpha / rank × the user's scale (the user's scale
alone when alpha is 0). The base weights are never changed: each backend runs the low-rank update beside them.
Norm vectors an adapter may carry (`*_norm.weight`) are ignored, as llama.cpp ignores them.

No NumPy here: the CUDA backend reads adapters on its cold path.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine import gguf
from engine.errors import GGUFError, InvalidInput, UnsupportedArchitecture
from engine.gguf import GGUFFile, TensorInfo
from engine.quants import GGMLType

ENV = "LORA_ADAPTERS"  # the worker's setting: "PATH[:SCALE],PATH[:SCALE],..."

# Base tensors (the name within a block, or "output") that every backend uses as a plain matmul weight, so the
# low-rank update has one meaning. token_embd is a row lookup (llama.cpp swaps A and B there): not adaptable.
ADAPTABLE = frozenset(
    {
        "attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate",
        "attn_q_a", "attn_q_b", "attn_kv_a_mqa",
        "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp",
        "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
        "ssm_in", "ssm_ba", "ssm_beta", "ssm_alpha", "ssm_out",
        "output",
    }
)  # fmt: skip
ADAPTER_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


@dataclass(frozen=True)
class LoraTensor:
    """The update of one base tensor. NumPy shapes: a (rank, in) or (E, rank, in); b (out, rank) or (E, out, rank)."""

    target: str  # the base tensor's GGUF name, e.g. "blk.0.attn_q.weight"
    a: TensorInfo
    b: TensorInfo
    rank: int
    scale: float  # the factor of B·(A·x): alpha / rank × the user's scale

    @property
    def short(self) -> str:
        """The name the models key the base weight by: "attn_q" for blk.N.attn_q.weight, "output" for output.weight."""
        parts = self.target.split(".")
        return parts[2] if parts[0] == "blk" else parts[0]

    @property
    def layer(self) -> int | None:
        parts = self.target.split(".")
        return int(parts[1]) if parts[0] == "blk" else None


@dataclass(frozen=True)
class Adapter:
    path: str
    user_scale: float
    alpha: float
    sha256: str
    tensors: dict[str, LoraTensor]  # base tensor name -> its update


def parse_spec(spec: str) -> tuple[str, float]:
    """ "PATH[:SCALE]" (the CLI's --lora, one entry of LORA_ADAPTERS) -> (path, scale); the scale defaults to 1."""
    path, sep, tail = spec.rpartition(":")
    if sep and path:
        try:
            scale = float(tail)
        except ValueError:
            path, scale = spec, 1.0  # a colon inside the path, no scale given
    else:
        path, scale = spec, 1.0
    if not path.strip():
        raise InvalidInput(f"LoRA adapter {spec!r}: empty path (expected PATH[:SCALE])")
    if not math.isfinite(scale):
        raise InvalidInput(f"LoRA adapter {spec!r}: the scale must be a finite number")
    return path, scale


def parse_env(value: str | None) -> list[tuple[str, float]]:
    """LORA_ADAPTERS ("PATH[:SCALE]" entries separated by commas) -> [(path, scale), ...]; unset or empty -> []."""
    if not value or not value.strip():
        return []
    try:
        return [parse_spec(part.strip()) for part in value.split(",") if part.strip()]
    except InvalidInput as e:
        raise InvalidInput(f"environment variable {ENV}: {e}") from None


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _pairs(af: GGUFFile) -> dict[str, tuple[TensorInfo | None, TensorInfo | None]]:
    """Adapter tensors grouped by base name: (lora_a, lora_b); unknown suffixes are a malformed file."""
    pairs: dict[str, list[TensorInfo | None]] = {}
    for name, info in af.tensors.items():
        for slot, suffix in enumerate((".lora_a", ".lora_b")):
            if name.endswith(suffix):
                pairs.setdefault(name.removesuffix(suffix), [None, None])[slot] = info
                break
        else:
            if not name.endswith("_norm.weight"):
                raise GGUFError(f"{af.path}: adapter tensor '{name}' is neither .lora_a nor .lora_b")
    return {k: (a, b) for k, (a, b) in pairs.items()}


def _check_pair(path: str, target: str, a: TensorInfo, b: TensorInfo, base: TensorInfo) -> int:
    """The rank of a well-formed pair for `base`; raises naming what does not fit."""
    for t in (a, b):
        if t.ggml_type not in ADAPTER_TYPES:
            raise UnsupportedArchitecture(f"{path}: adapter tensor '{t.name}' has type {t.ggml_type.name}; "
                                          "adapters must be F32, F16 or BF16")  # fmt: skip
    experts = len(base.ne) == 3
    want_dims = 3 if experts else 2
    if len(a.ne) != want_dims or len(b.ne) != want_dims:
        raise InvalidInput(f"{path}: '{target}' has ne {list(base.ne)} but its adapter pair has ne {list(a.ne)} "
                           f"and {list(b.ne)} (wrong base model?)")  # fmt: skip
    rank = a.ne[1]
    fits = a.ne[0] == base.ne[0] and b.ne[1] == base.ne[1] and b.ne[0] == rank and rank >= 1
    if experts:
        fits = fits and a.ne[2] == b.ne[2] == base.ne[2]
    if not fits:
        raise InvalidInput(f"{path}: adapter pair of '{target}' (lora_a ne {list(a.ne)}, lora_b ne {list(b.ne)}) "
                           f"does not fit the base tensor (ne {list(base.ne)}): wrong base model?")  # fmt: skip
    return rank


def open_adapter(path: str, user_scale: float, base: GGUFFile) -> Adapter:
    """Open one adapter and check it against the base model: file kind, architecture, names, shapes, types."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InvalidInput(f"LoRA adapter {path}: no such file")
    af = gguf.read(path)
    md = af.metadata
    if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
        raise GGUFError(f"{path}: not a LoRA adapter (general.type={md.get('general.type')!r}, "
                        f"adapter.type={md.get('adapter.type')!r}; expected 'adapter' and 'lora')")  # fmt: skip
    if af.architecture != base.architecture:
        raise InvalidInput(f"{path}: adapter for architecture '{af.architecture}', the model is "
                           f"'{base.architecture}'")  # fmt: skip
    alpha = md.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise GGUFError(f"{path}: adapter.lora.alpha must be a number, got {alpha!r}")
    tensors: dict[str, LoraTensor] = {}
    for target, (a, b) in sorted(_pairs(af).items()):
        if a is None or b is None:
            raise GGUFError(f"{path}: '{target}' has only one of lora_a / lora_b")
        base_info = base.tensors.get(target)
        if base_info is None:
            raise InvalidInput(f"{path}: adapter tensor for '{target}', which the model does not have "
                               "(wrong base model?)")  # fmt: skip
        parts = target.split(".")
        short = parts[2] if parts[0] == "blk" and len(parts) > 3 else target.removesuffix(".weight")
        if short not in ADAPTABLE or not target.endswith(".weight"):
            raise UnsupportedArchitecture(f"{path}: adapters of '{target}' are not supported (adaptable: "
                                          f"{', '.join(sorted(ADAPTABLE))})")  # fmt: skip
        rank = _check_pair(path, target, a, b, base_info)
        scale = user_scale * alpha / rank if alpha else user_scale
        tensors[target] = LoraTensor(target, a, b, rank, float(scale))
    if not tensors:
        raise GGUFError(f"{path}: the adapter holds no lora_a / lora_b pairs")
    return Adapter(path, float(user_scale), float(alpha), _file_sha256(path), tensors)


def open_adapters(specs: Iterable[tuple[str, float]] | None, base: GGUFFile) -> list[Adapter]:
    """Every adapter of `specs` ([(path, scale), ...]) opened and checked; [] for none."""
    out = []
    for spec in specs or []:
        if isinstance(spec, str):
            spec = parse_spec(spec)
        try:
            path, scale = spec
            scale = float(scale)
        except (TypeError, ValueError):
            raise InvalidInput(f"lora entries are (path, scale) pairs, got {spec!r}") from None
        out.append(open_adapter(path, scale, base))
    return out


def updates(adapters: Sequence[Adapter]) -> dict[str, list[LoraTensor]]:
    """Base tensor name -> its updates over all adapters, in the order given (several may adapt one tensor)."""
    out: dict[str, list[LoraTensor]] = {}
    for adapter in adapters:
        for target, t in adapter.tensors.items():
            out.setdefault(target, []).append(t)
    return out


def identity(adapters: Sequence[Adapter]) -> list[dict]:
    """What a state file or result records of the adapters: file name, sha256, the user's scale."""
    return [{"file": os.path.basename(a.path), "sha256": a.sha256, "scale": a.user_scale} for a in adapters]
