"""Sequence state files: the caches after a prompt (K/V rows, MLA latent rows, Gated DeltaNet conv/ssm state),
saved by `Engine.save_state` and resumed with `Engine.load(..., prefix_state=path)` or baked beside a model by
`python -m engine prepare MODEL --prefix TEXT` (docs/design.md §4).

Layout: b"RFLXSTATE\\n" | u64 header length | header JSON | zero padding | arrays, each at a 64-byte boundary.
The header names the format version, the model file's sha256, a hash of the model config and adapters, the
cache layout (`KVCache.STATE_LAYOUT`, ...), the producing backend, the token ids, and every array (name, dtype,
shape, offset, bytes). Every length and offset is checked against the file size before it is used.

No NumPy here: the CUDA backend resumes a state on its cold path (arrays are handed out as buffer offsets).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.errors import ContextOverflow, GGUFError, InvalidInput

MAGIC = b"RFLXSTATE\n"
FORMAT = "reflex-state"
VERSION = 1
ALIGN = 64
PREFIX_SUFFIX = ".reflex-prefix"  # the build-time prefix state beside a model: MODEL.gguf.reflex-prefix
_ITEMSIZE = {"f4": 4, "f2": 2}
_MAX_HEADER = 64 << 20  # far above any real header (token ids of a long prompt); guards the length field


def prefix_path(model_path: str) -> str:
    return os.fspath(model_path) + PREFIX_SUFFIX


def config_hash(config, adapters: Sequence[dict]) -> str:
    """sha256 of the model config (a frozen dataclass) and the adapters' identity: a state computed under other
    hyper-parameters or adapters means other K/V values."""
    blob = json.dumps({"config": dataclasses.asdict(config), "lora": list(adapters)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class ArrayInfo:
    name: str
    dtype: str  # "f4", or "f2" (K/V rows under KV_CACHE_TYPE=f16)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class Array:
    """One array to save: its bytes come as `chunks` (bytes-like objects, concatenated in C order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Iterable

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def save(path: str, header: dict, arrays: Sequence[Array]) -> dict:
    """Write a state file atomically (a reader never sees half of one). Returns a summary for the CLI."""
    path = os.fspath(path)
    table, offset = [], 0
    for a in arrays:
        table.append({"name": a.name, "dtype": a.dtype, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
        offset = _align(offset + a.nbytes)
    # Offsets in the header are relative to the data start, which depends on the header's own length.
    blob = json.dumps({"format": FORMAT, "version": VERSION, **header, "arrays": table}).encode()
    data_start = _align(len(MAGIC) + 8 + len(blob))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(blob)) + blob)
        for a, entry in zip(arrays, table, strict=True):
            f.write(b"\0" * (data_start + entry["offset"] - f.tell()))
            written = 0
            for chunk in a.chunks:
                written += f.write(chunk)
            if written != a.nbytes:
                raise AssertionError(f"state array {a.name}: {written} bytes written, {a.nbytes} expected")
    os.replace(tmp, path)
    return {"state": path, "bytes": os.path.getsize(path), "n_positions": header.get("n_positions")}


class StateFile:
    """An opened state file: `.header` (dict), `.arrays` (name -> ArrayInfo), `.mm` (the bytes, copy-on-write so
    the CUDA backend can take their address), `.token_ids`, `.n_positions`."""

    def __init__(self, path: str, mm: mmap.mmap, header: dict, arrays: dict[str, ArrayInfo]):
        self.path = path
        self.mm = mm
        self.header = header
        self.arrays = arrays
        self.token_ids: list[int] = header["token_ids"]
        self.n_positions: int = header["n_positions"]


def _bad(path: str, what: str) -> GGUFError:
    return GGUFError(f"{path}: not a usable state file: {what}")


def _array_info(path: str, entry, data_start: int, size: int) -> ArrayInfo:
    if not isinstance(entry, dict):
        raise _bad(path, "an array entry is not an object")
    name, dtype, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
    offset, nbytes = entry.get("offset"), entry.get("nbytes")
    if not isinstance(name, str) or dtype not in _ITEMSIZE:
        raise _bad(path, f"array {name!r} has dtype {dtype!r} (expected one of {sorted(_ITEMSIZE)})")
    ints = [offset, nbytes, *shape] if isinstance(shape, list) else None
    if ints is None or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise _bad(path, f"array {name!r} has a malformed shape, offset or size")
    expected = _ITEMSIZE[dtype]
    for s in shape:
        expected *= s
    start = data_start + offset
    if expected != nbytes or start + nbytes > size:
        raise _bad(path, f"array {name!r} ({nbytes} bytes at {start}, shape {shape}) does not fit a file of "
                         f"{size} bytes")  # fmt: skip
    return ArrayInfo(name, dtype, tuple(shape), start, nbytes)


def load(path: str) -> StateFile:
    """Open and parse a state file; raises GGUFError (kind `gguf`) on anything malformed or of another version."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(MAGIC) + 8:
                raise _bad(path, f"{size} bytes is too short")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise InvalidInput(f"cannot open state file {path}: {e}") from None
    if mm[: len(MAGIC)] != MAGIC:
        raise _bad(path, "bad magic")
    (n,) = struct.unpack_from("<Q", mm, len(MAGIC))
    if n > min(_MAX_HEADER, size - len(MAGIC) - 8):
        raise _bad(path, f"header length {n} exceeds the file")
    try:
        header = json.loads(mm[len(MAGIC) + 8 : len(MAGIC) + 8 + n])
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"header is not JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _bad(path, "no reflex-state header")
    if header.get("version") != VERSION:
        raise _bad(path, f"format version {header.get('version')!r}, this engine reads version {VERSION}")
    ids, n_pos = header.get("token_ids"), header.get("n_positions")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids) or n_pos != len(ids) or not ids:
        raise _bad(path, "token_ids / n_positions are malformed")
    entries = header.get("arrays")
    if not isinstance(entries, list):
        raise _bad(path, "no array table")
    data_start = _align(len(MAGIC) + 8 + n)
    arrays = {}
    for entry in entries:
        info = _array_info(path, entry, data_start, size)
        arrays[info.name] = info
    return StateFile(path, mm, header, arrays)


def check_pairing(sf: StateFile, model_sha256: str, cfg_hash: str, max_seq: int) -> None:
    """Refuse (kind `invalid_input`) a state made for another model file, config or adapter set."""
    h = sf.header
    if h.get("model_sha256") != model_sha256:
        raise InvalidInput(f"state file {sf.path} was made for another model (sha256 {str(h.get('model_sha256'))[:16]}"
                           f", this model is {model_sha256[:16]})")  # fmt: skip
    if h.get("config_hash") != cfg_hash:
        raise InvalidInput(f"state file {sf.path} was made under another model config or other LoRA adapters "
                           f"(recorded: {h.get('lora')})")  # fmt: skip
    if sf.n_positions > max_seq:
        raise ContextOverflow(sf.n_positions, max_seq, f"state file {sf.path}")


def check_layout(sf: StateFile, layout: str, spec: Sequence[tuple[str, str, tuple[int, ...]]]) -> None:
    """Refuse a state whose cache layout or arrays (name, dtype, shape) differ from what the runner holds."""
    if sf.header.get("layout") != layout:
        raise InvalidInput(f"state file {sf.path} has cache layout {sf.header.get('layout')!r} (backend "
                           f"{sf.header.get('backend')!r}); this runner's layout is {layout!r}")  # fmt: skip
    want = {name: (dtype, tuple(shape)) for name, dtype, shape in spec}
    got = {a.name: (a.dtype, a.shape) for a in sf.arrays.values()}
    if want != got:
        raise InvalidInput(f"state file {sf.path} holds arrays {got}, this runner needs {want}")
