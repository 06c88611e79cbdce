"""Mixture-of-experts FFN shared by qwen3moe, the qwen35 hybrids and deepseek2 (llama.cpp's build_moe_ffn).

probs  = softmax(ffn_gate_inp·x)  or  sigmoid(ffn_gate_inp·x)                 (over all experts)
select = probs + exp_probs_b; with expert groups keep the groups with the best top-2 sums
chosen = top-k(select);  w = probs[chosen] (/ sum, when weights_norm) (* weights_scale)
y      = sum_e w_e · ffn_down_exps[e](silu(ffn_gate_exps[e]·x) ⊙ ffn_up_exps[e]·x)  +  shared expert
"""

from __future__ import annotations

import numpy as np

from engine.config import MoE
from engine.cpu import ops

# llama.cpp clamps the weight sum before dividing, to the smallest normal f16, so a zero sum cannot blow up.
_MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


def route(logits: np.ndarray, moe: MoE, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Choose experts for each token.

    logits (n, n_experts) f32; bias (n_experts,) f32, which only steers the choice (DeepSeek V3's exp_probs_b).
    Returns chosen (n, k) int64, best first, and their weights (n, k) f32.
    """
    probs = ops.softmax(logits) if moe.gating == "softmax" else ops.sigmoid(logits)
    select = probs if bias is None else probs + bias
    if moe.n_groups > 1:
        select = _keep_best_groups(select, moe.n_groups, moe.n_groups_used)
    chosen = np.argsort(-select, axis=-1, kind="stable")[:, : moe.n_experts_used]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if moe.weights_norm:
        weights = weights / np.maximum(np.sum(weights, axis=-1, keepdims=True), _MIN_WEIGHT_SUM)
    if moe.weights_scale != 1.0:
        weights = weights * np.float32(moe.weights_scale)
    return chosen, weights.astype(np.float32, copy=False)


def _keep_best_groups(select: np.ndarray, n_groups: int, n_used: int) -> np.ndarray:
    """select (n, n_experts) with every expert outside the n_used groups of highest top-2 sum set to -inf."""
    n = select.shape[0]
    grouped = select.reshape(n, n_groups, -1)  # (n, n_groups, experts per group)
    group_score = np.sum(np.sort(grouped, axis=-1)[..., -2:], axis=-1)  # (n, n_groups)
    best = np.argsort(-group_score, axis=-1, kind="stable")[:, :n_used]
    dropped = np.ones((n, n_groups), dtype=bool)
    np.put_along_axis(dropped, best, False, axis=-1)
    return np.where(dropped[:, :, None], -np.inf, grouped).reshape(select.shape).astype(np.float32)


def moe_ffn(L: dict[str, np.ndarray], h: np.ndarray, moe: MoE) -> np.ndarray:
    """h (n, dim) f32 -> (n, dim) f32: the routed experts' weighted sum plus the shared expert, if any."""
    chosen, weights = route(h @ L["ffn_gate_inp"].T, moe, L.get("exp_probs_b"))
    out = np.zeros_like(h)
    # Expert by expert over the tokens that chose it; a token picks an expert at most once, so rows are unique.
    for e in np.unique(chosen):
        rows, slot = np.nonzero(chosen == e)
        y = ops.swiglu_ffn(h[rows], L["ffn_gate_exps"][e], L["ffn_up_exps"][e], L["ffn_down_exps"][e])
        out[rows] += weights[rows, slot, None] * y
    if moe.shared_hidden_dim:
        shared = ops.swiglu_ffn(h, L["ffn_gate_shexp"], L["ffn_up_shexp"], L["ffn_down_shexp"])
        if "ffn_gate_inp_shexp" in L:  # qwen3next/qwen35moe scale it by one sigmoid gate per token
            shared = shared * ops.sigmoid(h @ L["ffn_gate_inp_shexp"])[:, None]
        out += shared
    return out
