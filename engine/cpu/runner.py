"""The NumPy backend's runner: one sequence's cache and position around a family's CpuModel.

Runner API (the CUDA runner has the same): `reset()`, `position`, `forward(ids, out, gather)`,
`snapshot()` / `restore(state)` to return to an earlier position, and `sample_next(ids, params, step)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.errors import ContextOverflow
from engine.sampling import SamplingParams, sample


class CpuRunner:
    backend = "cpu"

    def __init__(self, model, max_seq: int):
        self.model = model
        self.cfg = model.cfg
        self.n_vocab = model.cfg.n_vocab
        self.max_seq = max_seq
        self.cache = model.new_cache(max_seq)
        self.position = 0  # tokens of the current sequence already in the cache

    def reset(self) -> None:
        self.position = 0
        self.cache.reset()

    def snapshot(self) -> object:
        """The state after the current position, to `restore` after feeding tokens that are to be forgotten."""
        return self.position, self.cache.snapshot()

    def restore(self, state: object) -> None:
        self.position, cache_state = state
        self.cache.restore(cache_state)

    def forward(self, ids: Sequence[int], out: str = "last", gather: Sequence[int] | None = None) -> np.ndarray | None:
        """Consume `ids` at the current position and return logits.

        out="none": nothing; out="last": the last position's logits (n_vocab,) or, with `gather`, only the columns
        `gather` (len(gather),); out="all": every position's logits (n, n_vocab) or, with `gather` (one id per
        position), logits[j, gather[j]] (n,).
        """
        n = len(ids)
        if self.position + n > self.max_seq:
            raise ContextOverflow(self.position + n, self.max_seq, "the sequence")
        h = self.model.forward(np.asarray(ids, dtype=np.int64), self.cache, self.position)  # (n, dim)
        self.position += n
        head = self.model.output  # (n_vocab, dim)
        if out == "none":
            return None
        if out == "last":
            rows = head if gather is None else head[np.asarray(gather, dtype=np.int64)]
            return rows @ h[-1]
        if out == "all":
            if gather is None:
                return h @ head.T
            return np.einsum("nd,nd->n", h, head[np.asarray(gather, dtype=np.int64)])
        raise ValueError(f"out must be none, last or all, got {out!r}")

    def sample_next(self, ids: Sequence[int], params: SamplingParams, step: int) -> int:
        """Consume `ids` and choose the next token."""
        return sample(self.forward(ids, "last"), params, step)
