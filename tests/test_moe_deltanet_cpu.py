"""The pieces that fail silently when wrong: expert routing, the MoE FFN, the causal conv and the delta rule."""

from __future__ import annotations

import numpy as np

from engine.config import MoE
from engine.cpu import deltanet, ops
from engine.models import moe as M


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _logit(p):
    p = np.asarray(p, np.float64)
    return np.log(p / (1.0 - p)).astype(np.float32)


def test_softmax_top_k_renormalised():
    moe = MoE(n_experts=4, n_experts_used=2, expert_hidden_dim=1, shared_hidden_dim=0)
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.25, 2.0]], np.float32)
    chosen, w = M.route(logits, moe)
    assert chosen.tolist() == [[1, 2], [3, 0]]
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = np.take_along_axis(p, chosen, -1)
    np.testing.assert_allclose(w, want / want.sum(-1, keepdims=True), rtol=1e-6)
    # Renormalised top-k of a softmax is the softmax over the chosen logits alone.
    np.testing.assert_allclose(w[0], np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum(), rtol=1e-6)


def test_softmax_without_norm_keeps_probabilities_and_scales():
    moe = MoE(n_experts=4, n_experts_used=2, expert_hidden_dim=1, shared_hidden_dim=0, weights_norm=False,
              weights_scale=2.5)  # fmt: skip
    logits = np.array([[1.0, 3.0, 2.0, 0.0]], np.float32)
    _, w = M.route(logits, moe)
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(w[0], 2.5 * p[[1, 2]], rtol=1e-6)


def test_sigmoid_bias_steers_the_choice_not_the_weights():
    moe = MoE(n_experts=4, n_experts_used=2, expert_hidden_dim=1, shared_hidden_dim=0, gating="sigmoid",
              weights_norm=False, weights_scale=2.5)  # fmt: skip
    logits = np.array([[0.0, 0.1, 0.2, 0.3]], np.float32)
    bias = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    chosen, w = M.route(logits, moe)
    assert chosen.tolist() == [[3, 2]]
    chosen, w = M.route(logits, moe, bias)
    assert chosen.tolist() == [[0, 3]]  # expert 0 only wins through its bias...
    np.testing.assert_allclose(w[0], 2.5 * _sigmoid([0.0, 0.3]), rtol=1e-6)  # ...and is weighed without it


def test_expert_groups_drop_the_losing_groups():
    # Groups of 2: top-2 sums 1.0, 1.2, 1.1, 0.6. Keeping 2 groups leaves experts 2..5, although expert 0 is best.
    p = [0.95, 0.05, 0.6, 0.6, 0.55, 0.55, 0.5, 0.1]
    logits = _logit(p)[None, :]
    grouped = MoE(n_experts=8, n_experts_used=2, expert_hidden_dim=1, shared_hidden_dim=0, gating="sigmoid",
                  n_groups=4, n_groups_used=2)  # fmt: skip
    chosen, w = M.route(logits, grouped)
    assert sorted(chosen[0].tolist()) == [2, 3]
    np.testing.assert_allclose(w[0], [0.5, 0.5], rtol=1e-5)
    plain = MoE(n_experts=8, n_experts_used=2, expert_hidden_dim=1, shared_hidden_dim=0, gating="sigmoid")
    assert M.route(logits, plain)[0][0].tolist()[0] == 0
    # Dropping only the weakest group (experts 6, 7) makes the feeble expert 1 beat expert 6 (0.5) for a place.
    six = MoE(n_experts=8, n_experts_used=6, expert_hidden_dim=1, shared_hidden_dim=0, gating="sigmoid",
              n_groups=4, n_groups_used=3)  # fmt: skip
    assert sorted(M.route(logits, six)[0][0].tolist()) == [0, 1, 2, 3, 4, 5]


def test_moe_ffn_equals_a_token_by_token_loop():
    rng = np.random.default_rng(5)
    n, d, e, f, s = 7, 16, 6, 8, 12
    moe = MoE(n_experts=e, n_experts_used=3, expert_hidden_dim=f, shared_hidden_dim=s)
    L = {
        "ffn_gate_inp": rng.standard_normal((e, d)).astype(np.float32),
        "ffn_gate_exps": rng.standard_normal((e, f, d)).astype(np.float32) * 0.3,
        "ffn_up_exps": rng.standard_normal((e, f, d)).astype(np.float32) * 0.3,
        "ffn_down_exps": rng.standard_normal((e, d, f)).astype(np.float32) * 0.3,
        "ffn_gate_shexp": rng.standard_normal((s, d)).astype(np.float32) * 0.3,
        "ffn_up_shexp": rng.standard_normal((s, d)).astype(np.float32) * 0.3,
        "ffn_down_shexp": rng.standard_normal((d, s)).astype(np.float32) * 0.3,
        "ffn_gate_inp_shexp": rng.standard_normal(d).astype(np.float32),
    }
    h = rng.standard_normal((n, d)).astype(np.float32)

    def expert(x, g, u, dn):
        a = g @ x
        return dn @ (a / (1 + np.exp(-a)) * (u @ x))

    want = np.zeros((n, d))
    for t in range(n):
        logits = L["ffn_gate_inp"] @ h[t]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:3]
        for j in top:
            want[t] += p[j] / p[top].sum() * expert(h[t], L["ffn_gate_exps"][j], L["ffn_up_exps"][j],
                                                   L["ffn_down_exps"][j])  # fmt: skip
        gate = _sigmoid(L["ffn_gate_inp_shexp"] @ h[t])
        want[t] += gate * expert(h[t], L["ffn_gate_shexp"], L["ffn_up_shexp"], L["ffn_down_shexp"])
    np.testing.assert_allclose(M.moe_ffn(L, h, moe), want, atol=2e-5)


def test_causal_conv_is_a_depthwise_convolution_with_carried_state():
    rng = np.random.default_rng(1)
    n, c, k = 9, 5, 4
    x = rng.standard_normal((n, c)).astype(np.float32)
    w = rng.standard_normal((c, k)).astype(np.float32)
    padded = np.concatenate([np.zeros((k - 1, c)), x])
    want = np.stack([[padded[t : t + k, ch] @ w[ch] for ch in range(c)] for t in range(n)])
    state = np.zeros((k - 1, c), np.float32)
    np.testing.assert_allclose(deltanet.causal_conv(x, state, w), want, atol=1e-5)
    np.testing.assert_array_equal(state, x[-(k - 1) :])
    # The same inputs fed in two pieces give the same outputs: the state carries the window across calls.
    state = np.zeros((k - 1, c), np.float32)
    parts = [deltanet.causal_conv(x[:2], state, w), deltanet.causal_conv(x[2:], state, w)]
    np.testing.assert_allclose(np.concatenate(parts), want, atol=1e-5)


def test_delta_rule_equals_its_matrix_form():
    """S_t = decay_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t, per head."""
    rng = np.random.default_rng(2)
    n, h, dk, dv = 6, 3, 4, 5
    q = ops.l2norm(rng.standard_normal((n, h, dk)).astype(np.float32), 1e-6) / np.float32(2.0)
    k = ops.l2norm(rng.standard_normal((n, h, dk)).astype(np.float32), 1e-6)
    v = rng.standard_normal((n, h, dv)).astype(np.float32)
    decay = rng.uniform(0.5, 1.0, (n, h)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (n, h)).astype(np.float32)
    S0 = rng.standard_normal((h, dk, dv)).astype(np.float32)

    S = S0.astype(np.float64)
    want = np.zeros((n, h, dv))
    for t in range(n):
        for j in range(h):
            kk = k[t, j][:, None]
            S[j] = decay[t, j] * (np.eye(dk) - beta[t, j] * kk @ kk.T) @ S[j] + beta[t, j] * kk @ v[t, j][None, :]
            want[t, j] = S[j].T @ q[t, j]
    state = S0.copy()
    np.testing.assert_allclose(deltanet.delta_rule(state, q, k, v, decay, beta), want, atol=1e-5)
    np.testing.assert_allclose(state, S, atol=1e-5)


def test_l2norm_softplus_sigmoid():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    np.testing.assert_allclose(ops.l2norm(x, 1e-6), [[0.6, 0.8], [0.0, 0.0]])
    big = np.array([-100.0, 0.0, 100.0], np.float32)
    np.testing.assert_allclose(ops.softplus(big), [0.0, np.log(2.0), 100.0], atol=1e-6)
    np.testing.assert_allclose(ops.sigmoid(big), [0.0, 0.5, 1.0], atol=1e-6)
