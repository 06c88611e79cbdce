"""Token choice on the host for the jobs that need the logits row: logprobs, and a grammar's mask.

`Chooser` is the engine's `chooser` hook (engine/generation.py): called with the host logits row of each step, it
applies the constraint's mask (engine/worker/structured.py), draws with the engine's own sampler (the same seeded
draw the device makes), and records the chosen token's log-probability and its top alternatives. Log-probabilities
are log-softmax of the model's raw logits (before temperature and mask), as OpenAI and vLLM report them. The
formatters shape the records as OpenAI's chat (`content: [{token, logprob, bytes, top_logprobs}]`) and completions
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) logprobs objects.
"""

from __future__ import annotations

from collections import deque
from typing import Any

MASKED = -3.4e38  # a finite stand-in for -inf: the sampler's checks take it, exp() makes it 0


class Chooser:
    def __init__(self, tokenizer, top: int | None, constraint=None):
        self.tokenizer = tokenizer
        self.top = top  # None: no logprobs; 0: the chosen token's only; k: and its k most likely alternatives
        self.constraint = constraint
        self.records: deque[tuple[int, float, list[tuple[int, float]]]] = deque()

    def __call__(self, logits, params, step: int) -> int:
        import numpy as np

        from engine.sampling import sample

        row = logits if self.constraint is None else self.constraint.masked(logits, MASKED)
        token = sample(row, params, step)
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.top is not None:
            x = logits.astype(np.float64)
            lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))  # log-softmax, stable
            alts: list[tuple[int, float]] = []
            if self.top:
                k = min(self.top, lp.shape[0])
                best = np.argpartition(-lp, k - 1)[:k]
                alts = sorted(((int(i), float(lp[i])) for i in best), key=lambda t: (-t[1], t[0]))
            self.records.append((token, float(lp[token]), alts))
        return token

    def take(self, n: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """The records of the next n generated tokens (a chunk's, or the rest)."""
        return [self.records.popleft() for _ in range(min(n, len(self.records)))]

    def _piece(self, token: int) -> bytes:
        return self.tokenizer.piece(token, skip_special=False)

    def chat(self, records: list) -> dict[str, Any]:
        """OpenAI chat logprobs: {"content": [...], "refusal": None}."""

        def entry(token: int, logprob: float) -> dict:
            b = self._piece(token)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}

        content = [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]} for t, lp, alts in records]
        return {"content": content, "refusal": None}

    def completion(self, records: list, offset: int = 0) -> dict[str, Any]:
        """OpenAI completions logprobs; `offset` is where the first token's text starts in the completion."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for t, lp, alts in records:
            text = self._piece(t).decode("utf-8", errors="replace")
            tokens.append(text)
            logprobs.append(lp)
            tops.append({self._piece(a).decode("utf-8", errors="replace"): alp for a, alp in alts})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
