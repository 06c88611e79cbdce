"""The build-time cache next to a model (`python -m engine prepare MODEL`) and the loader that uses it.

`<model>.reflex-cache` holds what the cold path would otherwise recompute from the GGUF header: the metadata
(without the vocabulary arrays), the tensor table, the file's sha256 and the tokenizer in its fast-loading form.
It lives beside the model and nowhere else (the loader looks there only). Nothing in it is trusted unchecked:
- its contents carry their own sha256, checked before any of it is trusted (a changed tensor offset is noticed;
  only the data offset and file size are read earlier, tentatively, to start hashing the model's identity on a
  thread);
- it names the model it was built from: the file's size, the sha256 of its header bytes (metadata and tensor
  table: everything before the tensor data) and the sha256 of a sample of the tensor data (SAMPLES blocks of
  SAMPLE_BYTES spread evenly over it, and its last block), so a cache copied beside another file with the same
  size and header is noticed too. A full-file hash would be exact but costs ~0.22 s per 400 MB on the cold path
  (sha256 at ~1.8 GB/s on the 2-core development machine); the modification time would be cheap but changes on
  every copy that does not preserve it, which would silently disable the cache in an image. The checks cost ~3 ms
  per 5.6 MB of cache (its digest) plus the header hash (~3 ms for a 150 K vocabulary) and ~0.1 ms of samples;
- it is read with bounded reads: a fixed preamble first (magic, section lengths, digest), and the body only when
  the lengths add up to the cache file's size and are within MAX_SECTION, so a garbage file costs one small read.
Any mismatch means: ignore the cache with a log line and parse the GGUF, which gives the same answer.

Layout: b"RFLXCACHE3\\n" | u64 JSON length | u64 tokenizer length | sha256(JSON + tokenizer) | JSON | tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import threading
from dataclasses import dataclass

from engine import files, gguf
from engine.errors import InvalidInput
from engine.files import FORMAT, MAGIC, MAX_SECTION, cache_path, cached_data_span, tentative_json
from engine.files import PREAMBLE as _PREAMBLE
from engine.quants import GGMLType
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "MAGIC", "MAX_SECTION", "OpenedModel", "cache_is_current", "cache_path", "cached_data_span",
           "file_sha256", "open_model", "write_cache"]  # fmt: skip

SAMPLES, SAMPLE_BYTES = 64, 1 << 14
_BIG_ARRAY = 1024  # arrays longer than this stay out of the cached metadata (the tokenizer carries the vocab)


@dataclass
class OpenedModel:
    file: gguf.GGUFFile
    tokenizer: Tokenizer | None  # None when there is no cache: the caller builds it (it is timed separately)
    sha256: str | None  # of the whole file, known only from a cache
    cache_used: bool


def cache_is_current(model_path: str) -> bool:
    """Whether the model has a cache of this format beside it (its magic only: the full checks run on open)."""
    try:
        with open(cache_path(model_path), "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def data_sample_sha256(mm, data_offset: int) -> str:
    """sha256 of SAMPLES blocks of SAMPLE_BYTES spread evenly over the tensor data, and of its last block."""
    h = hashlib.sha256()
    size = len(mm)
    span = max(0, size - data_offset)
    starts = {data_offset + span * i // SAMPLES for i in range(SAMPLES)} | {max(data_offset, size - SAMPLE_BYTES)}
    files.advise(mm, [(start, SAMPLE_BYTES) for start in starts])  # off a cold disk at once, not one by one
    view = memoryview(mm)
    for start in sorted(starts):
        h.update(view[start : start + SAMPLE_BYTES])
    return h.hexdigest()


def _identity(mm, data_offset: int) -> dict:
    files.advise(mm, [(0, data_offset)])
    return {"size": len(mm), "header_sha256": hashlib.sha256(memoryview(mm)[:data_offset]).hexdigest(),
            "data_sample_sha256": data_sample_sha256(mm, data_offset)}  # fmt: skip


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def write_cache(model_path: str) -> dict:
    """Parse the model, build its tokenizer and write the cache beside it. Returns a summary for the CLI."""
    gf = gguf.read(model_path)
    tokenizer = Tokenizer.from_gguf(gf)
    metadata = {k: _jsonable(v) for k, v in gf.metadata.items() if not (isinstance(v, (list, tuple)) or
                hasattr(v, "tolist")) or len(v) <= _BIG_ARRAY}  # fmt: skip
    header = {
        "format": FORMAT,
        "model": _identity(gf.mm, gf.data_offset),
        "file_sha256": file_sha256(model_path),
        "version": gf.version,
        "alignment": gf.alignment,
        "data_offset": gf.data_offset,
        "metadata": metadata,
        "tensors": [[t.name, int(t.ggml_type), list(t.ne), t.offset, t.n_bytes] for t in gf.tensors.values()],
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    tok = tokenizer.to_cache_bytes()
    out_path = cache_path(model_path)
    tmp = f"{out_path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + _PREAMBLE.pack(len(blob), len(tok), hashlib.sha256(blob + tok).digest()) + blob + tok)
        os.replace(tmp, out_path)  # readers never see a half-written cache
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise InvalidInput(f"cannot write the cache {out_path}: {e.strerror or e}") from None
    return {"cache": out_path, "bytes": os.path.getsize(out_path), "file_sha256": header["file_sha256"]}


def _read_cache(path: str) -> tuple[int, bytes, bytes]:
    """The cache's JSON length, its body (JSON + tokenizer) and the body's recorded digest, after checking its layout
    with bounded reads. The digest is not checked here (see _from_cache)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(len(MAGIC) + _PREAMBLE.size)
        if not head.startswith(MAGIC):
            raise ValueError("not a cache file of this format (bad magic)")
        if len(head) < len(MAGIC) + _PREAMBLE.size:
            raise ValueError("truncated preamble")
        n_json, n_tok, digest = _PREAMBLE.unpack_from(head, len(MAGIC))
        if max(n_json, n_tok) > MAX_SECTION or len(head) + n_json + n_tok != size:
            raise ValueError(f"its sections ({n_json} + {n_tok} bytes) do not match its size ({size} bytes)")
        return n_json, f.read(n_json + n_tok), digest


def _from_cache(model_path: str, cpath: str) -> OpenedModel | None:
    """The model through its cache, or None when the cache was built for another file. The model's identity (header
    and samples, ~3 ms of sha256 for a 150 K vocabulary) is hashed on a thread while this one checks the cache's own
    digest and builds the tokenizer from it (hashlib lets go of the GIL on large buffers). The data offset that bounds
    the header and the file size come from the JSON before its digest is checked: the thread starts only when they
    agree with the file and the header is within MAX_SECTION, and nothing is trusted unless the digest holds."""
    n_json, body, digest = _read_cache(cpath)
    early = tentative_json(body[:n_json])
    with open(model_path, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    early_offset, model = early.get("data_offset"), early.get("model")
    ahead = (type(early_offset) is int and 0 < early_offset <= min(size, MAX_SECTION) and isinstance(model, dict)
             and model.get("size") == size)  # fmt: skip
    found: dict = {}

    def hash_identity() -> None:
        with contextlib.suppress(Exception):  # found stays empty: a KeyError below, and the GGUF is parsed instead
            found.update(_identity(mm, early_offset))

    hashing = threading.Thread(target=hash_identity, daemon=True)
    if ahead:
        hashing.start()
    try:
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("its contents do not match their digest (a damaged or edited cache)")
        header = early or json.loads(body[:n_json])  # the strict read raises what the tentative one swallowed
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError("another format version")
        data_offset = header["data_offset"]
        if not (isinstance(data_offset, int) and data_offset > 0):
            raise ValueError(f"bad data offset {data_offset!r}")
        if size != header["model"]["size"]:
            log.info("ignoring the cache of %s: it was built for a file of another size", model_path)
            return None
        tokenizer = Tokenizer.from_cache_bytes(body[n_json:])  # marshal: only after the digest
    finally:
        if ahead:
            hashing.join()
    if not ahead:  # a header past MAX_SECTION: hashed here, after the digest
        found.update(_identity(mm, data_offset))
    for key, what in (("header_sha256", "its header bytes (metadata, tensor table)"),
                      ("data_sample_sha256", "its tensor data (sampled)")):  # fmt: skip
        if found[key] != header["model"][key]:
            log.info("ignoring the cache of %s: it was built for another file (%s differ)", model_path, what)
            return None
    gf = gguf.GGUFFile(model_path, mm, header["version"], header["metadata"], None, data_offset, header["alignment"])
    gf.identity = files.identity(st)
    gf.tensors = {
        name: gguf.TensorInfo(name, GGMLType(type_id), tuple(ne), offset, n_bytes, gf)
        for name, type_id, ne, offset, n_bytes in header["tensors"]
    }
    return OpenedModel(gf, tokenizer, header["file_sha256"], cache_used=True)


def open_model(model_path: str) -> OpenedModel:
    """The model through its cache when one is present and valid, else by parsing the GGUF."""
    model_path = os.fspath(model_path)
    cpath = cache_path(model_path)
    if os.path.exists(cpath):
        try:
            opened = _from_cache(model_path, cpath)
            if opened is not None:
                return opened
        except Exception as e:  # any defect of the cache only means: parse the model instead
            log.info("ignoring the unreadable cache %s: %s", cpath, e)
    return OpenedModel(gguf.read(model_path), None, None, cache_used=False)
