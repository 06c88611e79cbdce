"""Which tensors each model family needs, by GGUF name and shape: plain data, no NumPy, so the CUDA cold path can
validate a file without importing the NumPy backend. One function per family (`dense`, `hybrid`, `mla`), built from
the per-block lists; both backends resolve these and group them with `engine.weights.group_by_layer`."""

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


def deltanet_specs(cfg: ModelConfig, b: str) -> list[TensorSpec]:
    g = cfg.gdn
    assert g is not None
    d, h_v, value_dim = cfg.dim, g.n_v_heads, g.n_v_heads * g.head_v_dim
    # qwen3next files fuse beta/alpha (ssm_ba) and, from older converters, q/k/v/z (ssm_in), per k-head group.
    fused = cfg.arch == "qwen3next"
    return [
        TensorSpec(b + "attn_qkv.weight", (d, g.conv_dim), required=not fused),
        TensorSpec(b + "attn_gate.weight", (d, value_dim), required=not fused),
        TensorSpec(b + "ssm_in.weight", (d, g.conv_dim + value_dim), required=False),
        TensorSpec(b + "ssm_beta.weight", (d, h_v), required=not fused),
        TensorSpec(b + "ssm_alpha.weight", (d, h_v), required=not fused),
        TensorSpec(b + "ssm_ba.weight", (d, 2 * h_v), required=fused),
        TensorSpec(b + "ssm_conv1d.weight", (g.conv_kernel, g.conv_dim)),
        TensorSpec(b + "ssm_dt.bias", (h_v,)),
        TensorSpec(b + "ssm_a", (h_v,)),
        TensorSpec(b + "ssm_norm.weight", (g.head_v_dim,)),
        TensorSpec(b + "ssm_out.weight", (value_dim, d)),
    ]


def hybrid(cfg: ModelConfig) -> list[TensorSpec]:
    """qwen35 / qwen35moe / qwen3next: Gated DeltaNet or gated attention per layer, dense or MoE FFN."""
    assert cfg.gdn is not None
    out = head_specs(cfg)
    for i, recurrent in enumerate(cfg.gdn.recurrent):
        b = f"blk.{i}."
        out += [
            TensorSpec(b + "attn_norm.weight", (cfg.dim,)),
            TensorSpec(b + "post_attention_norm.weight", (cfg.dim,)),
        ]
        if recurrent:
            out += deltanet_specs(cfg, b)
        else:
            out += attention_specs(cfg, b, qk_norm=True, gated=True)
        out += ffn_specs(cfg, i)
    return out


def mla_attention_specs(cfg: ModelConfig, b: str) -> list[TensorSpec]:
    m = cfg.mla
    assert m is not None
    d, h, r, rope = cfg.dim, cfg.n_heads, m.kv_lora_rank, cfg.rope_dim
    q_rows = h * (m.qk_nope_dim + rope)
    if m.q_lora_rank:
        q = [
            TensorSpec(b + "attn_q_a.weight", (d, m.q_lora_rank)),
            TensorSpec(b + "attn_q_a_norm.weight", (m.q_lora_rank,)),
            TensorSpec(b + "attn_q_b.weight", (m.q_lora_rank, q_rows)),
        ]
    else:
        q = [TensorSpec(b + "attn_q.weight", (d, q_rows))]
    return [
        *q,
        TensorSpec(b + "attn_kv_a_mqa.weight", (d, r + rope)),
        TensorSpec(b + "attn_kv_a_norm.weight", (r,)),
        TensorSpec(b + "attn_k_b.weight", (m.qk_nope_dim, r, h)),  # per head (R, nope): q_nope -> latent
        TensorSpec(b + "attn_v_b.weight", (r, m.v_head_dim, h)),  # per head (v, R): latent -> value
        TensorSpec(b + "attn_output.weight", (h * m.v_head_dim, d)),
    ]


def mla(cfg: ModelConfig) -> list[TensorSpec]:
    """deepseek2: latent attention in every layer, leading dense FFNs, then MoE with shared experts."""
    out = head_specs(cfg)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        out += [TensorSpec(b + "attn_norm.weight", (cfg.dim,)), TensorSpec(b + "ffn_norm.weight", (cfg.dim,))]
        out += mla_attention_specs(cfg, b)
        out += ffn_specs(cfg, i)
    return out
