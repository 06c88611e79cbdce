"""ModelConfig: the frozen hyper-parameters of a model, read from GGUF metadata in one place.

This is the only module that reads `{arch}.*` keys. Shared pieces (attention shape, RoPE, norms) are read by
`_common`; each architecture family then has one section below that fills its own sub-config: `MoE` (routed
experts), `GatedDeltaNet` (the recurrent layers of the qwen35 hybrids) and `MLA` (deepseek2's latent attention).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine import archs
from engine.errors import GGUFError, UnsupportedArchitecture

_MISSING = object()
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # {arch}.expert_gating_func values llama.cpp implements for these


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_context: int = 0  # the YaRN ramp's n_ctx_orig (defaults to context_length)
    yarn_log_multiplier: float = 0.0  # mscale_all_dim (deepseek2 files store 0.1 times it; divided back here)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    attn_factor: float = 1.0  # rope.scaling.attn_factor, a plain multiplier on cos/sin
    mscale: float = 1.0  # the magnitude llama.cpp ends up giving cos/sin (derived, see _yarn_mscale)


@dataclass(frozen=True)
class MoE:
    """Routed experts: probs = gating(ffn_gate_inp·x); top-k of probs (+ exp_probs_b) picks experts; weights are
    the unbiased probs of the chosen, optionally renormalised and scaled."""

    n_experts: int
    n_experts_used: int
    expert_hidden_dim: int  # FFN width of one routed expert
    shared_hidden_dim: int  # width of the always-on shared expert FFN (all shared experts fused); 0 = none
    gating: str = "softmax"  # softmax | sigmoid
    weights_norm: bool = True  # divide the chosen weights by their sum
    weights_scale: float = 1.0  # then multiply them (DeepSeek's routed_scaling_factor)
    n_groups: int = 1  # expert groups; with > 1 only the n_groups_used best groups compete
    n_groups_used: int = 1
    n_dense_leading: int = 0  # layers 0..n-1 keep a dense FFN (deepseek2's leading_dense_block_count)


@dataclass(frozen=True)
class GatedDeltaNet:
    """The linear-attention layers of a hybrid model and the layer schedule."""

    recurrent: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or gated full attention (False)
    conv_kernel: int  # K of the causal depthwise conv1d; its state keeps the last K - 1 inputs
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    head_k_dim: int  # ssm.state_size
    head_v_dim: int  # ssm.inner_size / n_v_heads
    # Which k head a v head reads: "tiled" (qwen35 files: h % n_k_heads) or "grouped" (qwen3next: h // ratio).
    v_head_order: str
    rope_sections: tuple[int, ...] = ()  # MRoPE sections of the attention layers (all the same position for text)

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.head_k_dim + self.n_v_heads * self.head_v_dim


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention. The cache holds the normalised latent (kv_lora_rank) + the roped k_pe."""

    q_lora_rank: int  # 0: plain attn_q; else attn_q_a -> attn_q_a_norm -> attn_q_b
    kv_lora_rank: int
    qk_nope_dim: int  # per-head query/key dims without RoPE (key_length_mla - rope_dim)
    v_head_dim: int  # per-head value dims after decompression (value_length_mla)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int  # layers of the main pass (MTP/NextN layers appended to the file are not counted)
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
    moe: MoE | None = None
    gdn: GatedDeltaNet | None = None
    mla: MLA | None = None

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensors: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build from GGUF metadata. `tensors` (name -> info with `.ne`), when given, decides the vocabulary size
        (rows of `token_embd`), whether the head is tied, whether q/k are normed and the shared-expert width."""
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError("metadata has no string key 'general.architecture'")
        row = archs.get(arch)  # which sections below apply
        keys = _Keys(metadata, arch)
        cfg = _common(metadata, keys, tensors, row.rope)
        if row.moe == "qwen" and (not row.moe_optional or keys.int("expert_count", 0) > 0):
            cfg["moe"] = _qwen_moe(keys, cfg, tensors)
        if row.deltanet:
            cfg["gdn"] = _gated_deltanet(keys, cfg["n_layers"])
        if row.mla:
            cfg["mla"] = _mla(keys, cfg)
        if row.moe == "deepseek":
            cfg["moe"] = _deepseek_moe(keys, cfg, tensors)
        return cls(**cfg)


class _Keys:
    """Typed access to `{arch}.*` keys whose errors name the missing or malformed key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str):
        self.md = metadata
        self.arch = arch

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.md

    def _raw(self, key: str, default: Any) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.md:
            v = self.md[full]
            # The reader hands numeric arrays over as NumPy arrays; compare and validate them as lists.
            return full, v.tolist() if hasattr(v, "tolist") and not isinstance(v, (int, float)) else v
        if default is _MISSING:
            raise GGUFError(f"metadata key '{full}' is missing")
        return full, default

    def int(self, key: str, default: Any = _MISSING) -> int:
        full, v = self._raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise GGUFError(f"metadata key '{full}' must be a non-negative integer, got {v!r}")
        return v

    def layer_int(self, key: str, default: Any = _MISSING) -> int:
        """A key that hybrid files may store per layer (0 on the layers it does not apply to): the one value."""
        full, v = self._raw(key, default)
        if isinstance(v, list):
            values = {x for x in v if x}
            if len(values) != 1 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise GGUFError(f"metadata key '{full}' must hold one non-zero value per layer, got {v!r}")
            return values.pop()
        return self.int(key, default)

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

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        full, v = self._raw(key, default)
        if not isinstance(v, bool):
            raise GGUFError(f"metadata key '{full}' must be a bool, got {v!r}")
        return v

    def int_list(self, key: str, default: Any = _MISSING) -> tuple[int, ...]:
        full, v = self._raw(key, default)
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise GGUFError(f"metadata key '{full}' must be an array of integers, got {v!r}")
        return tuple(v)

    def bool_list(self, key: str, length: int) -> tuple[bool, ...]:
        full, v = self._raw(key, _MISSING)
        if not isinstance(v, (list, tuple)) or len(v) < length or not all(isinstance(x, bool) for x in v):
            raise GGUFError(f"metadata key '{full}' must be a bool array with one entry per layer, got {v!r}")
        return tuple(v[:length])


def _n_vocab(md: Mapping[str, Any], keys: _Keys, tensors: Mapping[str, Any] | None) -> int:
    embd = tensors.get("token_embd.weight") if tensors is not None else None
    if embd is not None and len(embd.ne) == 2:
        return int(embd.ne[1])
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    return keys.int("vocab_size")


def _yarn_mscale(arch: str, factor: float, log_mul: float, attn_factor: float) -> float:
    """The cos/sin magnitude llama.cpp's YaRN ends with: it sets attn_factor = m(factor, a) / m(factor, log_mul)
    (a = log_mul for deepseek2 unless 1, else 1; m(s, a) = 1 + 0.1·a·ln s for s > 1) when the file has a log
    multiplier, m(factor, 1) otherwise, divides by 1 + 0.1·ln factor, and ggml's rope multiplies that back."""

    def m(scale: float, a: float) -> float:
        return 1.0 if scale <= 1.0 else 1.0 + 0.1 * a * math.log(scale)

    if log_mul != 0.0:
        a = log_mul if arch == "deepseek2" and log_mul != 1.0 else 1.0
        return attn_factor * m(factor, a) / m(factor, log_mul)
    return attn_factor * m(factor, 1.0)


def _rope_scaling(keys: _Keys, n_ctx: int) -> RopeScaling:
    kind = keys.str("rope.scaling.type", "none")
    attn_factor = keys.float("rope.scaling.attn_factor", 1.0)
    if kind == "none":
        return RopeScaling(attn_factor=attn_factor, mscale=attn_factor)
    if kind not in ("linear", "yarn"):
        raise UnsupportedArchitecture(f"RoPE scaling type '{kind}' is not supported")
    factor = keys.float("rope.scaling.factor")
    if factor <= 0.0:
        raise GGUFError(f"'{keys.arch}.rope.scaling.factor' must be positive, got {factor}")
    log_mul = keys.float("rope.scaling.yarn_log_multiplier", 0.0)
    if keys.arch == "deepseek2":
        log_mul /= 0.1  # the converter stores 0.1 * mscale_all_dim; llama.cpp divides it back on load
    yarn = kind == "yarn"
    return RopeScaling(
        kind=kind,
        factor=factor,
        original_context=keys.int("rope.scaling.original_context_length", n_ctx) or n_ctx,
        yarn_log_multiplier=log_mul,
        yarn_beta_fast=keys.float("rope.scaling.yarn_beta_fast", 32.0),
        yarn_beta_slow=keys.float("rope.scaling.yarn_beta_slow", 1.0),
        attn_factor=attn_factor,
        mscale=_yarn_mscale(keys.arch, factor, log_mul, attn_factor) if yarn else attn_factor,
    )


def _any_layer_has(tensors: Mapping[str, Any] | None, suffix: str, n_layers: int) -> bool:
    return tensors is not None and any(f"blk.{i}.{suffix}" in tensors for i in range(n_layers))


def _common(md: Mapping[str, Any], keys: _Keys, tensors: Mapping[str, Any] | None, rope: str) -> dict[str, Any]:
    arch = keys.arch
    dim = keys.int("embedding_length")
    n_heads = keys.layer_int("attention.head_count")
    if n_heads == 0 or dim == 0:
        raise GGUFError(f"'{arch}.attention.head_count' and '{arch}.embedding_length' must be positive")
    n_kv_heads = keys.layer_int("attention.head_count_kv", n_heads)
    if n_kv_heads == 0 or n_heads % n_kv_heads:
        raise GGUFError(f"'{arch}.attention.head_count_kv'={n_kv_heads} must divide head_count={n_heads}")
    # Qwen3-0.6B projects 1024 -> 16 x 128: the head width is not dim / n_heads, it is key_length.
    head_dim = keys.int("attention.key_length", dim // n_heads)
    rope_dim = keys.int("rope.dimension_count", head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise GGUFError(f"'{arch}.rope.dimension_count'={rope_dim} must be even and at most the head width {head_dim}")
    # MTP/NextN blocks are appended after the trunk and counted in block_count; the main pass does not run them.
    n_layers = keys.int("block_count") - keys.int("nextn_predict_layers", 0)
    if n_layers <= 0:
        raise GGUFError(f"'{arch}.block_count' leaves no layers besides the nextn_predict_layers")
    n_ctx = keys.int("context_length", 4096)
    return dict(
        arch=arch,
        n_layers=n_layers,
        dim=dim,
        hidden_dim=keys.layer_int("feed_forward_length", 0),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        value_dim=keys.int("attention.value_length", head_dim),
        n_vocab=_n_vocab(md, keys, tensors),
        n_ctx=n_ctx,
        norm_eps=keys.float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_type=rope,
        rope_theta=keys.float("rope.freq_base", 10000.0),
        rope_dim=rope_dim,
        rope_scaling=_rope_scaling(keys, n_ctx),
        tied_output=tensors is None or "output.weight" not in tensors,
        qk_norm=_any_layer_has(tensors, "attn_q_norm.weight", n_layers),
    )


# -- MoE: qwen3moe, qwen35moe, qwen3next, Mixtral-style llama ----------------------------------------------------------


def _experts(keys: _Keys, cfg: dict[str, Any], tensors: Mapping[str, Any] | None) -> tuple[int, int, int]:
    """(n_experts, n_experts_used, expert_hidden_dim); llama.cpp falls back to n_ff / n_used for the width. The gate
    and up stacks must be apart: llama.cpp's converter, asked to (--fuse-gate-up-exps), writes one ffn_gate_up_exps
    stack instead (each expert's gate rows, then its up rows), which neither backend reads."""
    merged = next((n for n in tensors or () if n.endswith(".ffn_gate_up_exps.weight")), None)
    if merged is not None:
        raise UnsupportedArchitecture(
            f"tensor '{merged}': merged gate/up expert stacks are not supported (a file converted with "
            "--fuse-gate-up-exps); convert without it, for separate ffn_gate_exps and ffn_up_exps"
        )
    n_experts = keys.int("expert_count")
    n_used = keys.int("expert_used_count")
    if not 0 < n_used <= n_experts:
        raise GGUFError(f"'{keys.arch}.expert_used_count'={n_used} must be in 1..expert_count={n_experts}")
    width = keys.int("expert_feed_forward_length", 0) or cfg["hidden_dim"] // n_used
    if width == 0:
        raise GGUFError(f"metadata key '{keys.arch}.expert_feed_forward_length' is missing")
    return n_experts, n_used, width


def _shared_width(keys: _Keys, tensors: Mapping[str, Any] | None, first_moe_layer: int, fallback: int) -> int:
    """The shared expert's FFN width: from its tensor when the file is at hand, else from the keys."""
    if tensors is not None:
        info = tensors.get(f"blk.{first_moe_layer}.ffn_up_shexp.weight")
        return int(info.ne[1]) if info is not None and len(info.ne) == 2 else 0
    return keys.int("expert_shared_feed_forward_length", 0) or fallback


def _qwen_moe(keys: _Keys, cfg: dict[str, Any], tensors: Mapping[str, Any] | None) -> MoE:
    n_experts, n_used, width = _experts(keys, cfg, tensors)
    # llama.cpp hard-codes softmax routing with renormalised top-k weights for these; the scale is only applied
    # when a file sets one (0 and absent mean none), and qwen3moe never reads it.
    scale = 0.0 if keys.arch == "qwen3moe" else keys.float("expert_weights_scale", 0.0)
    return MoE(
        n_experts=n_experts,
        n_experts_used=n_used,
        expert_hidden_dim=width,
        shared_hidden_dim=_shared_width(keys, tensors, 0, 0),
        weights_scale=scale or 1.0,
    )


# -- Gated DeltaNet hybrids: qwen35, qwen35moe, qwen3next --------------------------------------------------------


def _layer_schedule(keys: _Keys, n_layers: int) -> tuple[bool, ...]:
    """Which layers are recurrent: the explicit bool array when present, else every layer but each
    full_attention_interval-th (interval 4 -> layers 3, 7, ... are full attention)."""
    if keys.has("attention.recurrent_layers"):
        return keys.bool_list("attention.recurrent_layers", n_layers)
    interval = keys.int("full_attention_interval", 4)
    if interval == 0:
        raise GGUFError(f"'{keys.arch}.full_attention_interval' must be positive")
    return tuple((i + 1) % interval != 0 for i in range(n_layers))


def _gated_deltanet(keys: _Keys, n_layers: int) -> GatedDeltaNet:
    n_k, n_v = keys.int("ssm.group_count"), keys.int("ssm.time_step_rank")
    head_k, inner = keys.int("ssm.state_size"), keys.int("ssm.inner_size")
    if n_k == 0 or n_v % n_k or inner % max(n_v, 1):
        raise GGUFError(
            f"'{keys.arch}.ssm.time_step_rank'={n_v} value heads must be a multiple of ssm.group_count={n_k} "
            f"and divide ssm.inner_size={inner}"
        )
    # The qwen35 converter reorders V heads from grouped to tiled (llama.cpp PR #19468); qwen3next files are not.
    order = "grouped" if keys.arch == "qwen3next" else "tiled"
    return GatedDeltaNet(
        recurrent=_layer_schedule(keys, n_layers),
        conv_kernel=keys.int("ssm.conv_kernel"),
        n_k_heads=n_k,
        n_v_heads=n_v,
        head_k_dim=head_k,
        head_v_dim=inner // n_v,
        v_head_order=order,
        rope_sections=keys.int_list("rope.dimension_sections", ()),
    )


# -- deepseek2: MLA attention, leading dense layers, then MoE with shared experts ------------------------------------


def _mla(keys: _Keys, cfg: dict[str, Any]) -> MLA:
    if not keys.has("attention.key_length_mla"):
        raise UnsupportedArchitecture(
            f"deepseek2 file without '{keys.arch}.attention.key_length_mla' (a pre-MLA conversion with attn_kv_b): "
            "re-convert it with a current llama.cpp"
        )
    kv_lora = keys.int("attention.kv_lora_rank")
    key_mla = keys.int("attention.key_length_mla")
    if key_mla <= cfg["rope_dim"] or cfg["head_dim"] != kv_lora + cfg["rope_dim"]:
        raise GGUFError(
            f"'{keys.arch}.attention.key_length'={cfg['head_dim']} must be kv_lora_rank + rope dims and "
            f"key_length_mla={key_mla} must exceed the rope dims {cfg['rope_dim']}"
        )
    return MLA(
        q_lora_rank=keys.int("attention.q_lora_rank", 0),  # missing or 0: no q-LoRA (V2-Lite)
        kv_lora_rank=kv_lora,
        qk_nope_dim=key_mla - cfg["rope_dim"],
        v_head_dim=keys.int("attention.value_length_mla"),
    )


def _deepseek_moe(keys: _Keys, cfg: dict[str, Any], tensors: Mapping[str, Any] | None) -> MoE:
    n_experts, n_used, width = _experts(keys, cfg, tensors)
    gating_func = keys.int("expert_gating_func", 0) or 1  # absent: softmax, as in DeepSeek V2/V2.5 files
    if gating_func not in _GATING_FUNCS:
        raise UnsupportedArchitecture(f"'{keys.arch}.expert_gating_func'={gating_func} is not supported")
    groups, groups_used = keys.int("expert_group_count", 1) or 1, keys.int("expert_group_used_count", 1) or 1
    if groups > 1 and (n_experts % groups or n_experts // groups < 2 or groups_used > groups):
        raise GGUFError(
            f"'{keys.arch}.expert_group_count'={groups} / expert_group_used_count={groups_used} do not split "
            f"{n_experts} experts into groups of at least 2"
        )
    leading = keys.int("leading_dense_block_count")
    return MoE(
        n_experts=n_experts,
        n_experts_used=n_used,
        expert_hidden_dim=width,
        shared_hidden_dim=_shared_width(keys, tensors, leading, width * keys.int("expert_shared_count", 0)),
        gating=_GATING_FUNCS[gating_func],
        weights_norm=keys.bool("expert_weights_norm", False),
        weights_scale=keys.float("expert_weights_scale", 0.0) or 1.0,  # 0 or absent: llama.cpp does not scale
        n_groups=groups,
        n_groups_used=groups_used,
        n_dense_leading=leading,
    )
