"""engine/cuda/vmm.py's page arithmetic without a GPU: after ensure(rows), every byte of rows 0..rows-1 of every
layer lies in a mapped granule, no granule is mapped twice, and a layer's new rows take one mapping."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cuda import vmm
from engine.cuda.memory import DeviceArray


class Pages(vmm.ByNeedArray):
    """ByNeedArray's bookkeeping with the driver calls replaced by a record of the runs mapped."""

    def __init__(self, shape: tuple[int, ...], gran: int):
        DeviceArray.__init__(self, 0, shape, "f4", owner=False)
        self.gran, self.layer_bytes = gran, self.nbytes // shape[0]
        self.row_bytes = self.layer_bytes // shape[1]
        self._pages, self._handles, self.mapped_rows, self.runs = set(), [], 0, []

    def _map(self, page: int, n: int) -> None:
        assert n >= 1 and not self._pages & set(range(page, page + n)), "a granule mapped twice"
        self.runs.append((page, n))
        self._pages.update(range(page, page + n))


@pytest.mark.parametrize("seed", range(20))
def test_rows_asked_for_are_mapped(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers, rows, width = int(rng.integers(1, 50)), int(rng.integers(1, 9000)), int(rng.choice([64, 576, 1024, 2048]))
    a = Pages((layers, rows, width), gran=int(rng.choice([1 << 16, 1 << 21])))
    for want in sorted(rng.integers(1, rows + 1, size=6)):
        before = len(a.runs)
        a.ensure(int(want))
        assert a.mapped_rows >= want and a.mapped_rows <= rows
        assert a.mapped_rows == rows or a.mapped_rows >= vmm.MIN_ROWS
        for layer in range(layers):
            lo = layer * a.layer_bytes
            hi = lo + a.mapped_rows * a.row_bytes
            assert set(range(lo // a.gran, -(-hi // a.gran))) <= a._pages, (seed, layer, want)
        assert len(a.runs) - before <= layers  # one run a layer at most
    assert a.mapped_bytes == len(a._pages) * a.gran <= -(-a.nbytes // a.gran) * a.gran


def test_growth_doubles_from_min_rows() -> None:
    a = Pages((2, 4096, 1024), gran=1 << 21)  # 4 KiB rows: 512 a granule, 8 granules a layer
    a.ensure(13)
    assert a.mapped_rows == vmm.MIN_ROWS and a.runs == [(0, 1), (8, 1)]
    a.ensure(vmm.MIN_ROWS)
    assert len(a.runs) == 2  # already there
    a.ensure(700)
    assert a.mapped_rows == 1024 and a.runs[2:] == [(1, 1), (9, 1)]
    a.ensure(4096)
    assert a.mapped_rows == 4096 and a._pages == set(range(16))
