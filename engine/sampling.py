"""Token choice: greedy, or temperature / top-k / top-p with a counter-based seeded draw.

The draw for step s of a request with seed S is `uniform(S, s)`, a SplitMix64 hash, not a stateful RNG, so a
request is reproducible from its seed alone and the CUDA sampler can make the very same draw on the device.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from engine.errors import InvalidInput, NonFiniteLogits

_MASK64 = (1 << 64) - 1
GREEDY_BELOW = 1e-5  # temperatures under this are greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise InvalidInput(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        # Below 1e-5 the distribution is a point mass for any real logits anyway, and logits / T could overflow.
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @staticmethod
    def make(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> SamplingParams:
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        if not 0 <= seed < 1 << 63:
            raise InvalidInput(f"seed must be in [0, 2^63), got {seed}")
        return SamplingParams(float(temperature), int(top_k), float(top_p), int(seed))


def uniform(seed: int, step: int) -> float:
    """A float in [0, 1) with 24 random bits: SplitMix64 of (seed, step). Mirrored by the device sampler."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 40) / float(1 << 24)


def sample(logits, params: SamplingParams, step: int) -> int:
    """logits (n_vocab,) f32 -> token id.

    Greedy: the lowest id among the maxima. Otherwise, with z = logits / T: keep the ids whose z is at least the
    k-th largest z (top-k; ties at the boundary stay in), then the smallest set of the most likely of those whose
    probability mass reaches top_p (again with ties), and draw from them in ascending id order with
    u = uniform(seed, step). Thresholds rather than a sorted list let the device sampler do the same with
    selection passes instead of a sort. NaN or infinite logits are the model's fault: NonFiniteLogits.
    """
    import numpy as np

    if not np.isfinite(logits).all():  # argmax would pick the first NaN: a token made of nothing
        raise NonFiniteLogits()
    if params.greedy:
        return int(np.argmax(logits))
    # float64: a temperature near zero must not overflow z to inf (then inf - inf = NaN); it must act greedy.
    z = logits.astype(np.float64) / params.temperature
    keep = np.ones(z.shape[0], dtype=bool)
    if 0 < params.top_k < z.shape[0]:
        keep = z >= np.partition(z, -params.top_k)[-params.top_k]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    if params.top_p < 1.0:
        desc = np.sort(p[keep])[::-1]
        cum = np.cumsum(desc, dtype=np.float64)
        last = min(int(np.searchsorted(cum, params.top_p * cum[-1], side="left")), len(desc) - 1)
        p = np.where(p >= desc[last], p, 0.0)
    cdf = np.cumsum(p, dtype=np.float64)
    u = uniform(params.seed, step) * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))
