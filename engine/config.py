"""ModelConfig: the frozen hyper-parameters of a model, read from GGUF metadata in one place.

This is the only module that reads `{arch}.*` keys. Each architecture family has one section below; shared pieces
(attention shape, RoPE, norms) are read by shared helpers so the families do not fork each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import GGUFError, UnsupportedArchitecture

# general.architecture -> RoPE pairing. "neox" rotates (x[i], x[i + n/2]); "norm" rotates (x[2i], x[2i+1]).
ROPE_TYPES = {"qwen3": "neox", "llama": "norm"}
SUPPORTED_ARCHITECTURES = tuple(ROPE_TYPES)

_MISSING = object()


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_context: int = 0
    yarn_log_multiplier: float = 0.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int  # residual stream width (embedding_length)
    hidden_dim: int  # FFN inner width (feed_forward_length)
    n_heads: int
    n_kv_heads: int
    head_dim: int  # per-head query/key width (attention.key_length)
    value_dim: int  # per-head value width (attention.value_length)
    n_vocab: int
    n_ctx: int  # training context length (context_length)
    norm_eps: float
    rope_type: str
    rope_theta: float
    rope_dim: int  # leading dims of each head that are rotated
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tied_output: bool = True  # no `output.weight`: the LM head is `token_embd`
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (qwen3)

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensors: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build from GGUF metadata. `tensors` (name -> info with `.ne`), when given, decides the vocabulary size
        (rows of `token_embd`), whether the head is tied and whether q/k are normed."""
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError("metadata has no string key 'general.architecture'")
        if arch not in ROPE_TYPES:
            raise UnsupportedArchitecture(
                f"architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return cls(**_common(metadata, arch, tensors))


class _Keys:
    """Typed access to `{arch}.*` keys whose errors name the missing or malformed key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str):
        self.md = metadata
        self.arch = arch

    def _raw(self, key: str, default: Any) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.md:
            return full, self.md[full]
        if default is _MISSING:
            raise GGUFError(f"metadata key '{full}' is missing")
        return full, default

    def int(self, key: str, default: Any = _MISSING) -> int:
        full, v = self._raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise GGUFError(f"metadata key '{full}' must be a non-negative integer, got {v!r}")
        return v

    def float(self, key: str, default: Any = _MISSING) -> float:
        full, v = self._raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise GGUFError(f"metadata key '{full}' must be a number, got {v!r}")
        return float(v)

    def str(self, key: str, default: Any = _MISSING) -> str:
        full, v = self._raw(key, default)
        if not isinstance(v, str):
            raise GGUFError(f"metadata key '{full}' must be a string, got {v!r}")
        return v


def _n_vocab(md: Mapping[str, Any], keys: _Keys, tensors: Mapping[str, Any] | None) -> int:
    embd = tensors.get("token_embd.weight") if tensors is not None else None
    if embd is not None and len(embd.ne) == 2:
        return int(embd.ne[1])
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    return keys.int("vocab_size")


def _rope_scaling(keys: _Keys) -> RopeScaling:
    kind = keys.str("rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind not in ("linear", "yarn"):
        raise UnsupportedArchitecture(f"RoPE scaling type '{kind}' is not supported")
    return RopeScaling(
        kind=kind,
        factor=keys.float("rope.scaling.factor"),
        original_context=keys.int("rope.scaling.original_context_length", 0),
        # The converter stores 0.1 * mscale_all_dim; llama.cpp divides it back on load.
        yarn_log_multiplier=keys.float("rope.scaling.yarn_log_multiplier", 0.0),
        yarn_beta_fast=keys.float("rope.scaling.yarn_beta_fast", 32.0),
        yarn_beta_slow=keys.float("rope.scaling.yarn_beta_slow", 1.0),
    )


def _common(md: Mapping[str, Any], arch: str, tensors: Mapping[str, Any] | None) -> dict[str, Any]:
    keys = _Keys(md, arch)
    dim = keys.int("embedding_length")
    n_heads = keys.int("attention.head_count")
    if n_heads == 0 or dim == 0:
        raise GGUFError(f"'{arch}.attention.head_count' and '{arch}.embedding_length' must be positive")
    n_kv_heads = keys.int("attention.head_count_kv", n_heads)
    if n_kv_heads == 0 or n_heads % n_kv_heads:
        raise GGUFError(f"'{arch}.attention.head_count_kv'={n_kv_heads} must divide head_count={n_heads}")
    # Qwen3-0.6B projects 1024 -> 16 x 128: the head width is not dim / n_heads, it is key_length.
    head_dim = keys.int("attention.key_length", dim // n_heads)
    rope_dim = keys.int("rope.dimension_count", head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise GGUFError(f"'{arch}.rope.dimension_count'={rope_dim} must be even and at most the head width {head_dim}")
    return dict(
        arch=arch,
        n_layers=keys.int("block_count"),
        dim=dim,
        hidden_dim=keys.int("feed_forward_length", 0),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        value_dim=keys.int("attention.value_length", head_dim),
        n_vocab=_n_vocab(md, keys, tensors),
        n_ctx=keys.int("context_length", 4096),
        norm_eps=keys.float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_type=ROPE_TYPES[arch],
        rope_theta=keys.float("rope.freq_base", 10000.0),
        rope_dim=rope_dim,
        rope_scaling=_rope_scaling(keys),
        tied_output=tensors is None or "output.weight" not in tensors,
        qk_norm=tensors is not None and "blk.0.attn_q_norm.weight" in tensors,
    )
