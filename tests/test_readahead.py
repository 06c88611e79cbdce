"""What starts a file's bytes coming off disk before they are read (engine/files.py): the prefetch's reads and when
it stops; the advice (advise): what is asked for, that it is only advice (never an error), off unless
REFLEX_READAHEAD=1, and the prepare cache's check asking for its header and samples at once."""

from __future__ import annotations

import mmap
import os
import shutil

import pytest

from engine import files, gguf, prepare
from tests import conformance as C

MODEL = C.fixture_path("qwen3-tiny-q8_0", ".gguf")


def test_prefetch_reads_from_its_start_to_the_end_until_told_to_stop(tmp_path, monkeypatch):
    monkeypatch.setenv("REFLEX_PREFETCH", "1")
    path = tmp_path / "f"
    path.write_bytes(os.urandom(10_000))
    assert files.prefetch(str(path), 1_000, lambda: False, chunk=4096) == 9_000  # 4096 + 4096 + 808
    checks = []
    assert files.prefetch(str(path), 0, lambda: checks.append(1) or len(checks) > 2, chunk=4096) == 8192
    assert files.prefetch(str(path), 0, lambda: True) == 0  # the context already exists: nothing read
    assert files.prefetch(str(path), 20_000, lambda: False) == 0  # past the end
    for unasked in ("0", ""):  # off unless asked for
        monkeypatch.setenv("REFLEX_PREFETCH", unasked)
        assert files.prefetch(str(path), 0, lambda: False) == 0
    monkeypatch.delenv("REFLEX_PREFETCH")
    assert files.prefetch(str(path), 0, lambda: False) == 0


def test_prefetch_never_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("REFLEX_PREFETCH", "1")
    assert files.prefetch(str(tmp_path / "gone"), 0, lambda: False) == 0
    assert files.prefetch(str(tmp_path), 0, lambda: False) == 0  # a directory
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert files.prefetch(str(path), -5, lambda: False) == 0  # a bad offset


class Mapping:
    """A mapping stand-in that records its madvise calls."""

    def __init__(self, size: int, fail: bool = False):
        self.size, self.fail, self.calls = size, fail, []

    def __len__(self) -> int:
        return self.size

    def madvise(self, option: int, start: int, length: int) -> None:
        if self.fail:
            raise OSError(22, "planted")
        self.calls.append((option, start, length))


@pytest.fixture
def readahead(monkeypatch):
    monkeypatch.setenv("REFLEX_READAHEAD", "1")


def test_advise_asks_for_page_aligned_ranges_inside_the_mapping(monkeypatch, readahead):
    page = mmap.PAGESIZE
    mm = Mapping(10 * page)
    files.advise(mm, [(0, 100), (3 * page + 5, 2 * page), (10 * page - 10, 1 << 20)])
    assert mm.calls == [(mmap.MADV_WILLNEED, 0, 100), (mmap.MADV_WILLNEED, 3 * page, 2 * page + 5),
                        (mmap.MADV_WILLNEED, 9 * page, page)]  # fmt: skip
    files.advise(Mapping(page, fail=True), [(0, 10)])  # refused: only advice
    odd = Mapping(10 * page)
    files.advise(odd, [(20 * page, 5), (0, 0), (-page, 10), (2**70, 1), (page, 1)])
    assert odd.calls == [(mmap.MADV_WILLNEED, page, 1)]  # the bad ranges skipped, the good one after them asked
    for unasked in ("0", ""):  # off unless asked for
        monkeypatch.setenv("REFLEX_READAHEAD", unasked)
        off = Mapping(page)
        files.advise(off, [(0, 10)])
        assert off.calls == []
    monkeypatch.delenv("REFLEX_READAHEAD")
    files.advise(off, [(0, 10)])
    assert off.calls == []


def test_advise_on_a_real_mapping(tmp_path, readahead):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * mmap.PAGESIZE + 7))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    files.advise(mm, [(1, 10), (2 * mmap.PAGESIZE + 3, mmap.PAGESIZE)])
    files.advise(mm, [(1.5, 2), (2**70, 1), (0, 2**70)])  # a float, past any offset, past the end: nothing raised
    assert mm[:4] == path.read_bytes()[:4]
    mm.close()


@pytest.mark.parametrize("cached", [True, False])
def test_opening_through_the_cache_asks_for_the_header_and_every_sample_first(tmp_path, monkeypatch, cached):
    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)
    prepare.write_cache(path)
    if not cached:
        os.unlink(prepare.cache_path(path))
    asked = []
    monkeypatch.setattr(files, "advise", lambda mm, ranges: asked.append(sorted(ranges)))
    opened = prepare.open_model(path)
    if not cached:
        assert asked == [] and not opened.cache_used
        return
    gf = gguf.read(path)
    assert opened.cache_used and asked[0] == [(0, gf.data_offset)]
    samples = asked[1]
    assert len(samples) == prepare.SAMPLES + 1 and all(n == prepare.SAMPLE_BYTES for _, n in samples)
    assert samples[0][0] == gf.data_offset and samples[-1][0] == gf.size - prepare.SAMPLE_BYTES
