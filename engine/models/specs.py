"""Which tensors each model family needs, by GGUF name and shape: plain data, no NumPy, so the CUDA cold path can
validate a file without importing the NumPy backend."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.weights import TensorSpec


def head_specs(cfg: ModelConfig) -> list[TensorSpec]:
    d = cfg.dim
    return [
        TensorSpec("token_embd.weight", (d, cfg.n_vocab)),
        TensorSpec("output_norm.weight", (d,)),
        TensorSpec("output.weight", (d, cfg.n_vocab), required=not cfg.tied_output),
    ]


def attention_specs(cfg: ModelConfig, b: str, qk_norm: bool, gated: bool = False) -> list[TensorSpec]:
    """Tensors of a GQA attention block. `gated`: attn_q also yields a per-head output gate (qwen35)."""
    d, hd, vd = cfg.dim, cfg.head_dim, cfg.value_dim
    q_rows = cfg.n_heads * hd * (2 if gated else 1)
    return [
        TensorSpec(b + "attn_q.weight", (d, q_rows)),
        TensorSpec(b + "attn_k.weight", (d, cfg.n_kv_heads * hd)),
        TensorSpec(b + "attn_v.weight", (d, cfg.n_kv_heads * vd)),
        TensorSpec(b + "attn_output.weight", (cfg.n_heads * vd, d)),
        TensorSpec(b + "attn_q_norm.weight", (hd,), required=qk_norm),
        TensorSpec(b + "attn_k_norm.weight", (hd,), required=qk_norm),
    ]


def moe_ffn(cfg: ModelConfig, b: str) -> list[TensorSpec]:
    """The MoE FFN tensors of the layer with prefix b ("blk.N."). GGUF ne of the stacks is [in, out, n_expert]."""
    moe = cfg.moe
    assert moe is not None
    d, e, f, s = cfg.dim, moe.n_experts, moe.expert_hidden_dim, moe.shared_hidden_dim
    specs = [
        TensorSpec(b + "ffn_gate_inp.weight", (d, e)),
        TensorSpec(b + "exp_probs_b.bias", (e,), required=False),
        TensorSpec(b + "ffn_gate_exps.weight", (d, f, e)),
        TensorSpec(b + "ffn_up_exps.weight", (d, f, e)),
        TensorSpec(b + "ffn_down_exps.weight", (f, d, e)),
    ]
    if s:
        specs += [
            TensorSpec(b + "ffn_gate_shexp.weight", (d, s)),
            TensorSpec(b + "ffn_up_shexp.weight", (d, s)),
            TensorSpec(b + "ffn_down_shexp.weight", (s, d)),
            TensorSpec(b + "ffn_gate_inp_shexp.weight", (d,), required=False),
        ]
    return specs


def ffn_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """The FFN of `layer`: routed experts when the model has them (past any leading dense layers), else dense."""
    b = f"blk.{layer}."
    if cfg.moe is not None and layer >= cfg.moe.n_dense_leading:
        return moe_ffn(cfg, b)
    d, f = cfg.dim, cfg.hidden_dim
    return [
        TensorSpec(b + "ffn_gate.weight", (d, f)),
        TensorSpec(b + "ffn_up.weight", (d, f)),
        TensorSpec(b + "ffn_down.weight", (f, d)),
    ]


def dense(cfg: ModelConfig) -> list[TensorSpec]:
    specs = [*head_specs(cfg), TensorSpec("rope_freqs.weight", (cfg.rope_dim // 2,), required=False)]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        specs += [TensorSpec(b + "attn_norm.weight", (cfg.dim,)), TensorSpec(b + "ffn_norm.weight", (cfg.dim,))]
        specs += attention_specs(cfg, b, qk_norm=cfg.qk_norm)
        specs += ffn_specs(cfg, i)
    return specs
