"""kernels/quant_i16.cuh's rounding of activations to 16 bits, in NumPy, for the tests of the kernels that use it."""

from __future__ import annotations

import numpy as np

HALF_STEP = 0.504  # |x - s q| <= HALF_STEP * s (tests/test_i16.py)


def round16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quant_i16.cuh's rounding of float32 rows, a group of 8 along the last axis: (q int16, s float32, sum of q
    int32), per group; q * s is the value the kernels dot with. (The kernel's 32767 / amax is a fast division, so a
    q may differ by one where x / s falls within a few ulp of a half.)"""
    g = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // 8, 8)
    amax = np.abs(g).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 1e-30, np.float32(32767) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(g.astype(np.float64) * inv[..., None].astype(np.float64)).astype(np.int16)
    s = (amax * np.float32(1 / 32767)).astype(np.float32)
    return q.reshape(x.shape), s, q.astype(np.int32).sum(-1)


def rounded(x: np.ndarray) -> np.ndarray:
    """x as the 16-bit forms see it: q * s, float64."""
    q, s, _ = round16(x)
    g = q.reshape(*x.shape[:-1], x.shape[-1] // 8, 8).astype(np.float64) * s[..., None]
    return g.reshape(x.shape)
