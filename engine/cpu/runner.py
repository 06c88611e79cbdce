"""The NumPy backend's runner: one sequence's cache and position around a family's CpuModel.

Runner API (the CUDA runner has the same): `reset()`, `position`, `forward(ids, out, gather)`,
`snapshot()` / `restore(state)` to return to an earlier position, `sample_next(ids, params, step)`,
`decode_chain(token, params, step, limit)` (the ids after token, one per decode step), and for state
files (engine/state.py) `state_layout`, `state_spec(n)`, `export_state()`, `import_state(state_file)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from engine import state
from engine.cpu import lora
from engine.errors import ContextOverflow
from engine.sampling import SamplingParams, sample


class CpuRunner:
    backend = "cpu"

    def __init__(self, model, max_seq: int, kv_dtype: str = "f4"):
        self.model = model
        self.cfg = model.cfg
        self.n_vocab = model.cfg.n_vocab
        self.max_seq = max_seq
        self.cache = model.new_cache(max_seq, kv_dtype)  # K/V elements "f4" or "f2" (engine/cache_type.py)
        self.position = 0  # tokens of the current sequence already in the cache
        # The state file whose position-indexed rows the cache still holds: resuming it again copies only the
        # recurrent state. Any write below its length (a sequence that does not start with it) forgets it.
        self._resident: state.StateFile | None = None

    def reset(self) -> None:
        self.position = 0
        self.cache.reset()

    def snapshot(self) -> object:
        """The state after the current position, to `restore` after feeding tokens that are to be forgotten."""
        return self.position, self.cache.snapshot()

    def restore(self, state: object) -> None:
        self.position, cache_state = state
        self.cache.restore(cache_state)

    def forward(
        self, ids: Sequence[int], out: str = "last", gather: Sequence[int] | Callable[[], Sequence[int]] | None = None
    ) -> np.ndarray | None:
        """Consume `ids` at the current position and return logits.

        out="none": nothing; out="last": the last position's logits (n_vocab,) or, with `gather`, only the columns
        `gather` (len(gather),); out="all": every position's logits (n, n_vocab) or, with `gather` (one id per
        position), logits[j, gather[j]] (n,). gather may be a callable that returns the ids: it is called once the
        forward has run here (the CUDA runner calls it while the device runs the forward).
        """
        n = len(ids)
        if self.position + n > self.max_seq:
            raise ContextOverflow(self.position + n, self.max_seq, "the sequence")
        if self._resident is not None and self.position < self._resident.n_positions:
            self._resident = None
        h = self.model.forward(np.asarray(ids, dtype=np.int64), self.cache, self.position)  # (n, dim)
        self.position += n
        if callable(gather):
            gather = gather()
        head = self.model.output  # (n_vocab, dim)
        if out == "none":
            return None
        if out == "last":
            rows = head if gather is None else head[np.asarray(gather, dtype=np.int64)]
            return rows @ h[-1]
        if out == "all":
            if gather is None:
                return h @ head.T
            return lora.row_dots(head[np.asarray(gather, dtype=np.int64)], h)
        raise ValueError(f"out must be none, last or all, got {out!r}")

    def sample_next(self, ids: Sequence[int], params: SamplingParams, step: int) -> int:
        """Consume `ids` and choose the next token."""
        return sample(self.forward(ids, "last"), params, step)

    def decode_chain(self, token: int, params: SamplingParams, step: int, limit: int) -> Iterator[int]:
        """The next `limit` ids at most, each chosen after consuming the one before (`token` first), with steps
        step, step + 1, ...: what sample_next gives one call at a time. Stop iterating at any point."""
        for i in range(limit):
            token = self.sample_next([token], params, step + i)
            yield token

    # -- state files ---------------------------------------------------------------------------------------

    @property
    def state_layout(self) -> str:
        return self.cache.STATE_LAYOUT

    def state_spec(self, n: int) -> list[tuple[str, str, tuple]]:
        """(name, dtype, shape) of every array of a state after n positions."""
        return self.cache.state_spec(n)

    def export_state(self) -> list[state.Array]:
        """The cache after the current position, as the arrays of a state file."""
        arrays = self.cache.state_arrays(self.position)
        return [state.Array(k, a.dtype.str[1:], a.shape, [np.ascontiguousarray(a).data]) for k, a in arrays.items()]

    def import_state(self, sf: state.StateFile) -> None:
        """Continue from a state file's position (checked against this runner by engine/state.py already)."""
        arrays = {
            name: np.frombuffer(sf.mm, np.dtype(info.dtype), info.nbytes // np.dtype(info.dtype).itemsize,
                                info.offset).reshape(info.shape)
            for name, info in sf.arrays.items()
        }  # fmt: skip
        self.cache.load_state(arrays, sf.n_positions, positional=self._resident is not sf)
        self._resident = sf
        self.position = sf.n_positions
