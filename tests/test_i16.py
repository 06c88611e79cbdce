"""tests/i16.py, the NumPy form of kernels/quant_i16.cuh's rounding that the GPU tests hold the 16-bit kernels to:
its own contract, on the CPU."""

from __future__ import annotations

import numpy as np

from tests.i16 import HALF_STEP, round16, rounded


def test_round16_bounds() -> None:
    """The rounding's own contract: |x - s q| <= 0.504 s (s / 2, plus q times the float32 rounding of s and 1 / s),
    |q| <= 32767; zeros stay zero."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(64, 256)) * np.exp(rng.normal(size=(64, 1)) * 4)).astype(np.float32)
    x[3, :8] = 0.0
    q, s, qsum = round16(x)
    err = np.abs(x.astype(np.float64) - rounded(x)).reshape(64, 32, 8)
    assert (err <= s[..., None] * HALF_STEP).all() and np.abs(q.astype(np.int32)).max() <= 32767
    assert (q[3, :8] == 0).all() and qsum[3, 0] == 0
