"""A fast, defensive GGUF reader (versions 2 and 3): struct + mmap, zero-copy tensor views.

Every count and offset read from the file is checked against the bytes that remain before anything is allocated
from it, so a malformed file ends in a `GGUFError` that names the file, what was wrong and at which byte offset.
The work of a parse is bounded too, whatever the file holds: at most MAX_KV metadata entries, MAX_TENSORS tensors,
MAX_NESTED arrays inside arrays, MAX_STRINGS strings in arrays, MAX_SLOW_STRINGS of them read one by one (each
checked against its count before any of it is read), so a crafted header is refused in milliseconds instead of
costing seconds and gigabytes of Python objects. Real files are far inside these bounds (tens of keys, a few
thousand tensors, no nested arrays).
String arrays (vocabularies, merges) take a vectorized path: see `_read_string_array`.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from engine import files
from engine.errors import GGUFError
from engine.quants import BLOCK_SIZES, GGMLType, type_name

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_NESTING = 8
MAX_ELEMENTS = 1 << 50  # far beyond any real tensor; guards the element-count product against overflow
# The work budget of one parse (see the module docstring).
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 17
MAX_NESTED = 1 << 12  # arrays inside arrays, over the whole file (each costs a Python object or more)
MAX_STRINGS = 1 << 21  # strings in arrays, over the whole file (a real vocabulary and its merges: ~300 K)
MAX_SLOW_STRINGS = 1 << 19  # of those, strings that the vectorized reader cannot take

# GGUF value type id -> (struct format, byte size); 8 (string) and 9 (array) are handled separately.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. `ne` is GGUF order (ne[0] contiguous); `shape` is the NumPy order (reversed)."""

    name: str
    ggml_type: GGMLType
    ne: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int
    _file: GGUFFile

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def data(self):
        """Zero-copy read-only uint8 view of the tensor's bytes: (n_bytes,) u8."""
        import numpy as np

        return np.frombuffer(self._file.mm, dtype=np.uint8, count=self.n_bytes, offset=self.offset)


class GGUFFile:
    """An opened GGUF file: `.metadata` (key -> value), `.tensors` (name -> TensorInfo), the mmap and its layout.

    Metadata values: int / float / bool / str scalars; string arrays as `list[str]`; numeric arrays as read-only
    1-D NumPy views into the file; nested arrays as lists.
    """

    def __init__(self, path: str | os.PathLike, mm: mmap.mmap, version: int, metadata: dict[str, Any],
                 tensors: dict[str, TensorInfo] | None, data_offset: int, alignment: int):  # fmt: skip
        self.path = os.fspath(path)
        self.mm = mm
        self.size = len(mm)
        self.identity: tuple | None = None  # engine.files.identity of the file opened, where the opener records it
        self.version = version
        self.metadata = metadata
        self.tensors: dict[str, TensorInfo] = tensors if tensors is not None else {}
        self.data_offset = data_offset  # first byte of the tensor data section
        self.alignment = alignment

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: missing string key 'general.architecture'")
        return arch

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor '{name}' is missing") from None

    def header_bytes(self) -> memoryview:
        """Everything before the tensor data: metadata and tensor infos (what a prepare cache is keyed to)."""
        return memoryview(self.mm)[: self.data_offset]


def read(path: str | os.PathLike) -> GGUFFile:
    """Open and parse a GGUF file. Raises GGUFError on anything malformed."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size < 24:
                raise GGUFError(f"{path}: file is {st.st_size} bytes, too short for a GGUF header (24 bytes)")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(f"{path}: cannot open: {e.strerror or e}") from e
    gf = _Parser(path, mm).parse()
    gf.identity = files.identity(st)
    return gf


class _Parser:
    def __init__(self, path: str, mm: mmap.mmap):
        self.path = path
        self.mm = mm
        self.size = len(mm)
        self.pos = 0
        self.nested_left = MAX_NESTED
        self.strings_left = MAX_STRINGS
        self.slow_strings_left = MAX_SLOW_STRINGS

    def over_budget(self, what: str, n: int, limit: int, at: int) -> GGUFError:
        return self.fail(f"{what} {n} is over the reader's limit of {limit} (a crafted header?)", at)

    def fail(self, what: str, at: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (at byte offset {self.pos if at is None else at})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated file: {what} needs {n} bytes, {self.size - self.pos} remain")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.mm, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.mm, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = self.mm[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8", at=start) from None

    def parse(self) -> GGUFFile:
        if self.mm[:4] != MAGIC:
            raise self.fail(f"bad magic {bytes(self.mm[:4])!r}, expected {MAGIC!r}", at=0)
        self.pos = 4
        version = self.u32("version")
        if version not in (2, 3):
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            hint = " (a big-endian file, which is not supported)" if swapped in (2, 3) else ""
            raise self.fail(f"unsupported GGUF version {version}{hint}; versions 2 and 3 are read", at=4)
        n_tensors = self.u64("tensor count")
        n_kv = self.u64("metadata count")
        # Smallest possible encodings: a KV is 8 (key length) + 4 (type) + 1; a tensor info 8 + 4 + 4 + 8.
        if n_kv * 13 > self.size - self.pos:
            raise self.fail(f"metadata count {n_kv} cannot fit in the {self.size - self.pos} bytes left", at=16)
        if n_tensors * 24 > self.size - self.pos:
            raise self.fail(f"tensor count {n_tensors} cannot fit in the {self.size - self.pos} bytes left", at=8)
        if n_kv > MAX_KV:
            raise self.over_budget("metadata count", n_kv, MAX_KV, 16)
        if n_tensors > MAX_TENSORS:
            raise self.over_budget("tensor count", n_tensors, MAX_TENSORS, 8)

        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key_at = self.pos
            key = self.string(f"key of metadata entry {i}")
            if key in metadata:
                raise self.fail(f"duplicate metadata key '{key}'", at=key_at)
            vtype = self.u32(f"value type of '{key}'")
            metadata[key] = self.value(vtype, key, depth=0)

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        bad = isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
        if bad or alignment & (alignment - 1):
            raise self.fail(f"general.alignment must be a positive power of two, got {alignment!r}")

        infos = [self.tensor_info(i) for i in range(n_tensors)]
        # A file without tensors (vocab-only) may end before the padding; each tensor's span is checked below.
        data_offset = -(-self.pos // alignment) * alignment
        gf = GGUFFile(self.path, self.mm, version, metadata, None, data_offset, alignment)
        gf.tensors = self.check_tensors(gf, infos, data_offset, alignment)
        return gf

    def value(self, vtype: int, key: str, depth: int) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            fmt, n = scalar
            self.need(n, f"value of '{key}'")
            (v,) = struct.unpack_from(fmt, self.mm, self.pos)
            self.pos += n
            return v
        if vtype == _STRING:
            return self.string(f"value of '{key}'")
        if vtype == _ARRAY:
            return self.array(key, depth)
        raise self.fail(f"unknown value type {vtype} for key '{key}'", at=self.pos - 4)

    def array(self, key: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"arrays nested deeper than {MAX_ARRAY_NESTING} in '{key}'")
        etype = self.u32(f"element type of '{key}'")
        count_at = self.pos
        count = self.u64(f"element count of '{key}'")
        remaining = self.size - self.pos
        if etype in _SCALARS:
            n = _SCALARS[etype][1]
            if count * n > remaining:
                raise self.fail(f"array '{key}' of {count} elements cannot fit in the {remaining} bytes left", count_at)
            import numpy as np

            if etype == _BOOL:  # one vectorized comparison, not a Python bool per byte
                out = np.frombuffer(self.mm, dtype=np.uint8, count=count, offset=self.pos) != 0
            else:
                out = np.frombuffer(self.mm, dtype=_NUMPY_DTYPES[etype], count=count, offset=self.pos)
            self.pos += count * n
            return out
        if etype == _STRING:
            if count * 8 > remaining:
                raise self.fail(f"array '{key}' of {count} strings cannot fit in the {remaining} bytes left", count_at)
            return self.string_array(key, count)
        if etype == _ARRAY:
            # Each nested array needs at least its 12-byte header.
            if count * 12 > remaining:
                raise self.fail(f"array '{key}' of {count} arrays cannot fit in the {remaining} bytes left", count_at)
            if count > self.nested_left:
                raise self.over_budget(f"arrays nested in '{key}': count", count, MAX_NESTED, count_at)
            self.nested_left -= count
            return [self.array(key, depth + 1) for _ in range(count)]
        raise self.fail(f"unknown element type {etype} in array '{key}'", at=count_at - 4)

    def string_array(self, key: str, count: int) -> list[str]:
        if count > self.strings_left:
            raise self.over_budget(f"strings in '{key}': count", count, MAX_STRINGS, self.pos - 8)
        self.strings_left -= count
        out = _read_string_array(self.mm, self.pos, count) if count >= 256 else None
        if out is not None:
            strings, self.pos = out
            return strings
        if count > self.slow_strings_left:
            raise self.over_budget(f"strings of '{key}' to read one by one: count", count, MAX_SLOW_STRINGS, self.pos)
        self.slow_strings_left -= count
        return self.plain_strings(key, count)

    def plain_strings(self, key: str, count: int) -> list[str]:
        """The sequential read of `count` strings (the loop is kept tight: it is the slow path's whole cost)."""
        mm, pos, size, unpack = self.mm, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            end = pos + 8 + (unpack(mm, pos)[0] if pos + 8 <= size else size)
            if end > size:
                self.pos = pos
                raise self.fail(f"truncated file: element {i} of '{key}' runs past the end of the file ({size})")
            try:
                append(mm[pos + 8 : end].decode("utf-8"))
            except UnicodeDecodeError:
                raise self.fail(f"element {i} of '{key}' is not valid UTF-8", at=pos) from None
            pos = end
        self.pos = pos
        return out

    def tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int, int]:
        at = self.pos
        name = self.string(f"name of tensor {i}")
        n_dims = self.u32(f"dimension count of tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"tensor '{name}' has {n_dims} dimensions; 1 to {MAX_DIMS} are allowed", at)
        ne = tuple(self.u64(f"dimension {d} of tensor '{name}'") for d in range(n_dims))
        type_id = self.u32(f"type of tensor '{name}'")
        offset = self.u64(f"data offset of tensor '{name}'")
        return name, ne, type_id, offset, at

    def check_tensors(self, gf: GGUFFile, infos: list, data_offset: int, alignment: int) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, rel_offset, at in infos:
            if name in tensors:
                raise self.fail(f"duplicate tensor name '{name}'", at)
            try:
                ggml_type = GGMLType(type_id)
                block, block_bytes = BLOCK_SIZES[ggml_type]
            except (ValueError, KeyError):
                raise self.fail(f"tensor '{name}' has unknown ggml type id {type_id}", at) from None
            n = 1
            for d in ne:
                n *= d
                if n > MAX_ELEMENTS:
                    raise self.fail(f"tensor '{name}' has an absurd shape {list(ne)}", at)
            if ne[0] % block:
                raise self.fail(
                    f"tensor '{name}' ({type_name(type_id)}) has ne[0]={ne[0]}, not a multiple of its block {block}", at
                )
            n_bytes = n // block * block_bytes
            if rel_offset % alignment:
                raise self.fail(f"tensor '{name}' data offset {rel_offset} is not aligned to {alignment}", at)
            start = data_offset + rel_offset
            if start + n_bytes > self.size:
                raise self.fail(
                    f"tensor '{name}' data [{start}, {start + n_bytes}) runs past the end of the file ({self.size})", at
                )
            tensors[name] = TensorInfo(name, ggml_type, ne, start, n_bytes, gf)
        spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in tensors.values() if t.n_bytes)
        for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
            if start_b < end_a:
                raise self.fail(f"tensors '{a}' and '{b}' overlap in the data section", start_b)
        return tensors


def _read_string_array(mm: mmap.mmap, pos: int, count: int) -> tuple[list[str], int] | None:
    """Vectorized read of `count` length-prefixed strings at `pos`; None sends the caller to the plain loop.

    A string is a u64 length then its bytes. For text without NUL bytes and lengths 1..255, each header is exactly
    "a non-zero byte followed by seven zero bytes", which NumPy finds in one pass over the bytes. Runs of candidate
    headers are accepted only while they chain exactly (next = this + 8 + length), which is the sequential parse
    itself, so an accepted run cannot be wrong. The few strings outside the pattern (empty, >= 256 bytes) are read
    one by one between runs. The scan starts over a window sized for short strings and grows if that was too small.
    """
    remaining = len(mm) - pos
    window = min(remaining, count * 24)
    while True:
        out = _scan_string_array(mm, pos, count, window)
        if out != "grow" or window == remaining:
            return None if out == "grow" else out
        window = min(remaining, window * 4)


def _scan_string_array(mm: mmap.mmap, pos: int, count: int, window: int):
    import numpy as np

    if window < 8:
        return "grow"
    w = np.frombuffer(mm, dtype=np.uint8, count=window, offset=pos)
    zero = w == 0
    seven = zero[1 : window - 6].copy()
    for k in range(2, 8):
        seven &= zero[k : window - 7 + k]
    candidates = np.flatnonzero(seven & ~zero[: window - 7])

    strings: list[str] = []
    cur = 0
    irregular = rounds = 0
    while len(strings) < count:
        rounds += 1
        if rounds > 64 and rounds * 32 > len(strings):  # runs too short to pay for their NumPy calls
            return None
        i = int(np.searchsorted(candidates, cur))
        if i < len(candidates) and candidates[i] == cur:
            run = candidates[i : i + count - len(strings)]
            ends = run + 8 + w[run]
            breaks = np.flatnonzero(run[1:] != ends[:-1])
            n = int(breaks[0]) + 1 if len(breaks) else len(run)
            n = int(np.searchsorted(ends[:n], window, side="right"))
            if n == 0:
                return "grow"
            run, end = run[:n], int(ends[n - 1])
            # With the length bytes zeroed each header is eight NULs; when the text holds no NUL of its own, one
            # split recovers every string of the run.
            if int(np.count_nonzero(zero[cur:end])) != 7 * n:
                return None
            span = w[cur:end].copy()
            span[run - cur] = 0
            try:
                text = span.tobytes().decode("utf-8").split("\x00" * 8)
            except UnicodeDecodeError:
                return None  # the plain loop names the offending element
            if len(text) != n + 1:
                return None
            strings += text[1:]
            cur = end
        elif cur + 8 <= window and not w[cur : cur + 8].any():
            # Empty strings, their headers eight zero bytes each, one after another: as many as there are zero words.
            k = min(count - len(strings), (window - cur) // 8)
            nonzero = np.flatnonzero(np.frombuffer(mm, dtype="<u8", count=k, offset=pos + cur))
            m = int(nonzero[0]) if len(nonzero) else k
            strings += [""] * m
            cur += 8 * m
        else:
            irregular += 1
            if irregular > 64:
                return None
            if cur + 8 > window:
                return "grow"
            (length,) = _U64.unpack_from(mm, pos + cur)
            if cur + 8 + length > window:
                return "grow"
            try:
                strings.append(mm[pos + cur + 8 : pos + cur + 8 + length].decode("utf-8"))
            except UnicodeDecodeError:
                return None
            cur += 8 + length
    return strings, pos + cur
