"""The build-time cache next to a model (`python -m engine prepare MODEL`) and the loader that uses it.

`<model>.reflex-cache` holds what the cold path would otherwise recompute from the GGUF header: the metadata
(without the vocabulary arrays), the tensor table, the file's sha256 and the tokenizer in its fast-loading form.
It is keyed to the file by its size and the sha256 of its header bytes (everything before the tensor data), so an
edited or replaced model is noticed; a stale or unreadable cache is ignored with a log line, never trusted.

Layout: b"RFLXCACHE1\\n" | u64 json length | JSON | u64 tokenizer length | tokenizer bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass

from engine import gguf
from engine.quants import GGMLType
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAGIC = b"RFLXCACHE1\n"
FORMAT = 1
_BIG_ARRAY = 1024  # arrays longer than this stay out of the cached metadata (the tokenizer carries the vocab)


@dataclass
class OpenedModel:
    file: gguf.GGUFFile
    tokenizer: Tokenizer | None  # None when there is no cache: the caller builds it (it is timed separately)
    sha256: str | None  # of the whole file, known only from a cache
    cache_used: bool


def cache_path(model_path: str) -> str:
    return model_path + ".reflex-cache"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def write_cache(model_path: str, out_path: str | None = None) -> dict:
    """Parse the model, build its tokenizer and write the cache. Returns a summary for the CLI."""
    gf = gguf.read(model_path)
    tokenizer = Tokenizer.from_gguf(gf)
    metadata = {k: _jsonable(v) for k, v in gf.metadata.items() if not (isinstance(v, (list, tuple)) or
                hasattr(v, "tolist")) or len(v) <= _BIG_ARRAY}  # fmt: skip
    header = {
        "format": FORMAT,
        "size": gf.size,
        "header_sha256": hashlib.sha256(gf.header_bytes()).hexdigest(),
        "file_sha256": file_sha256(model_path),
        "version": gf.version,
        "alignment": gf.alignment,
        "data_offset": gf.data_offset,
        "metadata": metadata,
        "tensors": [[t.name, int(t.ggml_type), list(t.ne), t.offset, t.n_bytes] for t in gf.tensors.values()],
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    tok = tokenizer.to_cache_bytes()
    out_path = out_path or cache_path(model_path)
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(blob)) + blob + struct.pack("<Q", len(tok)) + tok)
    os.replace(tmp, out_path)  # readers never see a half-written cache
    return {"cache": out_path, "bytes": os.path.getsize(out_path), "file_sha256": header["file_sha256"]}


def _read_cache(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise ValueError("not a cache file (bad magic)")
    pos = len(MAGIC)
    (n,) = struct.unpack_from("<Q", data, pos)
    header = json.loads(data[pos + 8 : pos + 8 + n])
    pos += 8 + n
    (m,) = struct.unpack_from("<Q", data, pos)
    tok = data[pos + 8 : pos + 8 + m]
    if len(tok) != m or header.get("format") != FORMAT:
        raise ValueError("truncated cache or another format version")
    return header, tok


def _from_cache(model_path: str, header: dict, tok: bytes) -> OpenedModel | None:
    with open(model_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != header["size"]:
            log.info("ignoring stale cache for %s: the file size changed", model_path)
            return None
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hashlib.sha256(memoryview(mm)[: header["data_offset"]]).hexdigest() != header["header_sha256"]:
        log.info("ignoring stale cache for %s: the header bytes changed", model_path)
        return None
    gf = gguf.GGUFFile(model_path, mm, header["version"], header["metadata"], None, header["data_offset"],
                       header["alignment"])  # fmt: skip
    gf.tensors = {
        name: gguf.TensorInfo(name, GGMLType(type_id), tuple(ne), offset, n_bytes, gf)
        for name, type_id, ne, offset, n_bytes in header["tensors"]
    }
    return OpenedModel(gf, Tokenizer.from_cache_bytes(tok), header["file_sha256"], cache_used=True)


def open_model(model_path: str) -> OpenedModel:
    """The model through its cache when one is present and valid, else by parsing the GGUF."""
    model_path = os.fspath(model_path)
    cpath = cache_path(model_path)
    if os.path.exists(cpath):
        try:
            header, tok = _read_cache(cpath)
            opened = _from_cache(model_path, header, tok)
            if opened is not None:
                return opened
        except Exception as e:  # any defect of the cache only means: parse the model instead
            log.info("ignoring unreadable cache %s: %s", cpath, e)
    return OpenedModel(gguf.read(model_path), None, None, cache_used=False)
