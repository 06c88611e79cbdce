"""The recurrent half of a Gated DeltaNet layer, one token at a time (the oracle for the CUDA kernels).

llama.cpp prefills with a chunked (WY) form of the same recurrence; running it token by token is the same math.
Every function updates the state it is given in place, so the caller's cache carries it to the next call.
"""

from __future__ import annotations

import numpy as np


def causal_conv(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Depthwise causal conv1d over the new inputs, without bias or activation.

    x (n, C) f32 the new inputs; state (K-1, C) f32 the previous K-1 inputs, oldest first (zeros at the start of a
    sequence), replaced by the last K-1 inputs; w (C, K) f32, w[:, K-1] weighing the current input.
    Returns (n, C) f32: out[t, c] = sum_j w[c, j] * window[t + j, c] with window = [state; x].
    """
    n, k = x.shape[0], w.shape[1]
    window = np.concatenate([state, x])  # (K-1+n, C)
    out = np.zeros_like(x)
    for j in range(k):
        out += window[j : j + n] * w[:, j]
    state[:] = window[n:]
    return out


def delta_rule(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray,
               beta: np.ndarray) -> np.ndarray:  # fmt: skip
    """The gated delta rule over n tokens.

    S (H, Dk, Dv) f32: one state matrix per v head, updated in place.
    q, k (n, H, Dk) f32: already L2-normalised, expanded to the v heads, q scaled by 1/sqrt(Dk).
    v (n, H, Dv) f32; decay (n, H) f32 in (0, 1); beta (n, H) f32 in (0, 1).
    Per token: S <- decay S; S <- S + k (beta (v - S^T k))^T; o = S^T q. Returns o (n, H, Dv) f32.
    """
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        S *= decay[t, :, None, None]
        predicted = np.einsum("hkv,hk->hv", S, k[t])  # what the state recalls for this key
        delta = beta[t, :, None] * (v[t] - predicted)
        S += k[t, :, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out
