"""engine/text/packed.py: packed string tables answer as the dicts they stand for, before and after they build
their dict; a tokenizer loaded from its packed cache encodes as the one built from the GGUF, past the point where
its tables turn into dicts."""

from __future__ import annotations

import marshal
import os

import numpy as np
import pytest

from engine import gguf
from engine.errors import TokenizerError
from engine.text import packed
from engine.text.packed import PackedStrings, PackedTable
from engine.text.tokenizer import _CACHE_MAGIC, Tokenizer
from tests.test_tokenizer import QWEN3_CASES, TOK_FIXTURES


def _random_keys(rng: np.random.Generator, n: int) -> list[str]:
    """Distinct keys: empty, prefixes of one another, ASCII, Latin-1, CJK and astral code points."""
    alphabet = ["a", "b", " ", "Ġ", "é", "中", "\U0001f600", "z"]
    keys = {"", "a", "ab", "abc", "b"}
    while len(keys) < n:
        keys.add("".join(rng.choice(alphabet, size=int(rng.integers(1, 7)))))
    return sorted(keys, key=lambda _: rng.random())


@pytest.mark.parametrize("in_order", [True, False])
def test_table_answers_as_its_dict(in_order: bool) -> None:
    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    keys = _random_keys(rng, 300)
    want = {k: int(v) for k, v in zip(keys, rng.integers(-(2**40), 2**40, size=len(keys)), strict=True)}
    if in_order:
        table = PackedTable.pack(want.items())
    else:  # keys in id order, values their index, order by text: the vocabulary's form
        want = {k: i for i, k in enumerate(keys)}
        order = packed.array("q", sorted(range(len(keys)), key=keys.__getitem__))
        table = PackedTable(PackedStrings.pack(keys), order)
    probes = [*keys, "absent", "a" * 9, "Ġ中", "\x00", "ab "]
    for k in probes:  # bisected
        assert table.get(k) == want.get(k) and (k in table) == (k in want)
        assert table.get(k, -7) == want.get(k, -7)
    assert table.get(5) is None and 5 not in table
    with pytest.raises(KeyError):
        table["absent"]
    assert len(table) == len(want) and table._dict is None
    assert dict(table.items()) == want and table._dict is not None  # iterating builds the dict
    for k in probes:  # from the dict
        assert table.get(k) == want.get(k) and (k in table) == (k in want)


def test_table_builds_its_dict_after_enough_lookups(monkeypatch) -> None:
    monkeypatch.setattr(packed, "MATERIALIZE_AFTER", 10)
    table = PackedTable.pack({"x": 1, "y": 2}.items())
    for _ in range(10):
        assert table["x"] == 1
    assert table._dict is None
    assert table["y"] == 2 and table._dict == {"x": 1, "y": 2}


def test_strings_refuse_ends_that_do_not_fit() -> None:
    with pytest.raises(ValueError):
        PackedStrings("abc", packed.array("q", [1, 4]))
    s = PackedStrings.pack(["", "ab", "c"])
    assert [s[i] for i in range(3)] == ["", "ab", "c"] and s[-1] == "c" and len(s) == 3


def test_cached_tokenizer_encodes_as_the_gguf_one_past_its_dicts() -> None:
    fresh = Tokenizer.from_gguf(gguf.read(os.path.join(TOK_FIXTURES, "qwen3-vocab.gguf")))
    cached = Tokenizer.from_cache_bytes(fresh.to_cache_bytes())
    assert isinstance(cached._vocab, PackedTable) and cached._vocab._dict is None
    texts = [c["text"] for c in QWEN3_CASES]
    for t in texts:  # short texts first: bisected lookups
        assert cached.encode(t) == fresh.encode(t)
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyzé中")
    words = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(3000)]
    long = " ".join([*texts, *words])  # distinct words: enough lookups (past the word cache) to build both dicts
    assert cached.encode(long) == fresh.encode(long)
    assert cached._vocab._dict is not None and cached._ranks._dict is not None
    ids = fresh.encode(long)
    assert cached.decode(ids) == fresh.decode(ids)


@pytest.mark.parametrize(
    "body",
    [
        b"{}\n" + marshal.dumps(()),
        b'{"attrs": [[], []]}\n' + marshal.dumps(("ab", b"\x01", b"", "", b"", b"")),  # ends not whole int64s
        b'{"attrs": [[], []]}\n' + marshal.dumps(("ab", (5).to_bytes(8, "little"), b"", "", b"", b"")),
        b'{"attrs": [[], []]}\n' + marshal.dumps((1, b"", b"", "", b"", b"")),
        b"{}\n\xff\xfe",
    ],
)
def test_damaged_packed_cache_is_a_tokenizer_error(body: bytes) -> None:
    with pytest.raises(TokenizerError):
        Tokenizer.from_cache_bytes(_CACHE_MAGIC + body)
