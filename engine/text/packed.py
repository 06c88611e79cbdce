"""Read-only string tables that load without building a dict: the tokenizer's vocabulary and merge ranks from the
prepare cache.

A 150 K vocabulary and its merges as two dicts cost ~100 ms to load (marshal, measured on the 2-core development
machine and on an H200 host alike: creating and hashing ~300 K strings), on the main thread of every cold start.
Packed, each table is one str (the keys back to back) and arrays of ints, which load in a few ms; a lookup bisects
the keys in code-point order, a slice a step (~10 us). A short prompt (a system1 job) needs a few hundred lookups; a
table that has answered MATERIALIZE_AFTER of them turns itself into a dict, as the table of a tokenizer built from
the GGUF is, so a long prompt pays the dict once and then looks up at dict speed.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import accumulate

MATERIALIZE_AFTER = 2048  # lookups a packed table answers by bisection before it builds its dict
_MISSING = object()


def ints(data: bytes) -> array:
    """An array of int64 from its bytes (native order: written and read on the same machine)."""
    a = array("q")
    a.frombytes(data)
    return a


class PackedStrings(Sequence[str]):
    """n strings back to back in one str: string i is blob[ends[i - 1]:ends[i]] (from 0 for the first). Integer
    indices only."""

    __slots__ = ("blob", "ends")

    def __init__(self, blob: str, ends: array):
        if ends and (ends[-1] != len(blob) or ends[0] < 0):  # the cache's digest vouches for the rest
            raise ValueError("packed strings: the ends do not fit the text")
        self.blob, self.ends = blob, ends

    @classmethod
    def pack(cls, strings: Iterable[str]) -> PackedStrings:
        strings = list(strings)
        return cls("".join(strings), array("q", accumulate(len(s) for s in strings)))

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        ends = self.ends
        return self.blob[ends[i - 1] if i else 0 : ends[i]]


class _InOrder(Sequence[str]):
    """keys[order[j]] for j < len(order): the keys in code-point order, for bisect."""

    __slots__ = ("keys", "order")

    def __init__(self, keys: PackedStrings, order: array | None):
        self.keys, self.order = keys, order

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, j: int) -> str:  # type: ignore[override]
        return self.keys[j if self.order is None else self.order[j]]


class PackedTable(Mapping[str, int]):
    """A read-only str -> int mapping over packed, distinct keys: key k is keys[k], its value values[k] (k itself
    when values is None); order lists the k in code-point order of their keys (None: keys are in that order)."""

    def __init__(self, keys: PackedStrings, order: array | None = None, values: array | None = None):
        if (order is not None and len(order) != len(keys)) or (values is not None and len(values) != len(keys)):
            raise ValueError("packed table: keys, order and values differ in length")
        self._keys, self._order, self._values = keys, order, values
        self._sorted = _InOrder(keys, order)
        self._dict: dict[str, int] | None = None
        self._lookups = 0

    @property
    def packed_keys(self) -> PackedStrings:
        return self._keys

    @property
    def packed_values(self) -> array | None:
        return self._values

    @classmethod
    def pack(cls, items: Iterable[tuple[str, int]]) -> PackedTable:
        """The table of `items` (distinct keys), keys stored in code-point order."""
        pairs = sorted(items)
        return cls(PackedStrings.pack(k for k, _ in pairs), None, array("q", (v for _, v in pairs)))

    def get(self, key: object, default: object = None) -> object:  # type: ignore[override]
        d = self._dict
        if d is None:
            self._lookups += 1
            if self._lookups <= MATERIALIZE_AFTER:
                if not isinstance(key, str):
                    return default
                s = self._sorted
                j = bisect_left(s, key)
                if j == len(s) or s[j] != key:
                    return default
                k = j if self._order is None else self._order[j]
                return k if self._values is None else self._values[k]
            d = self.materialize()
        return d.get(key, default)  # type: ignore[call-overload]

    def __getitem__(self, key: str) -> int:
        v = self.get(key, _MISSING)
        if v is _MISSING:
            raise KeyError(key)
        return v  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self.materialize())

    def materialize(self) -> dict[str, int]:
        """The table as a dict, built once; later lookups use it."""
        d = self._dict
        if d is None:
            keys = self._keys
            values = range(len(keys)) if self._values is None else self._values.tolist()
            d = dict(zip((keys[k] for k in range(len(keys))), values, strict=True))
            self._dict = d
        return d
