"""system1: score a fixed set of candidate continuations of one prompt.

score = raw logit of the candidate's first token after the prompt, plus, for a multi-token candidate, the raw
logit of each later token with the earlier ones teacher-forced. probability = softmax(score / T) over the
candidates only; entropy in bits; the best is the highest score, ties going to the last maximum (by score, not by
probability: at an extreme temperature distinct scores underflow to equal probabilities).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.errors import InvalidInput, NonFiniteLogits


def candidate_ids(encode, prompt: str, candidates: Sequence[str]) -> list[list[int]]:
    """ids_c = encode(prompt + c)[len(encode(prompt)):], checked to be a clean continuation (no BOS here)."""
    base = encode(prompt)
    out = []
    for i, text in enumerate(candidates):
        ids = encode(prompt + text)
        if ids[: len(base)] != base:
            raise InvalidInput(
                f"candidate {i} ({text!r}) does not tokenize as a clean continuation of the prompt: "
                "the prompt's tokens change when it is appended (try a leading space)"
            )
        if len(ids) == len(base):
            raise InvalidInput(f"candidate {i} ({text!r}) adds no tokens to the prompt")
        out.append(ids[len(base) :])
    return out


def probabilities(scores: Sequence[float], temperature: float) -> list[float]:
    if not (math.isfinite(temperature) and temperature > 0):
        raise InvalidInput(f"system1 temperature must be a finite number > 0, got {temperature}")
    if not all(math.isfinite(s) for s in scores):  # the model's logits, not the request, are at fault
        raise NonFiniteLogits("candidate scores (logits)")
    m = max(scores)
    e = [math.exp((s - m) / temperature) for s in scores]
    total = sum(e)
    return [x / total for x in e]


def entropy_bits(probs: Sequence[float]) -> float:
    return 0.0 - sum(p * math.log2(p) for p in probs if p > 0.0)  # 0.0 - 0.0: no "-0.0" for a certain answer


def best_index(scores: Sequence[float]) -> int:
    """Index of the largest score; on a tie the last one."""
    best = 0
    for i, s in enumerate(scores):
        if s >= scores[best]:
            best = i
    return best
