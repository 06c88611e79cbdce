"""Cheap facts about a model's files, read before the heavy imports (the CUDA context's thread uses them to start the
weight upload while the main thread still imports): which file, in which state (`identity`), and the prepare cache's
layout (engine/prepare.py writes and checks the cache; the constants and the tentative read of its data span live here
so that reading them imports nothing but the standard library's json and struct), and what starts a file's bytes
coming off disk before they are needed (`prefetch`, `advise`).
"""

from __future__ import annotations

import json
import os
import struct

MAGIC = b"RFLXCACHE3\n"  # 3: the tokenizer packed (engine/text/packed.py)
FORMAT = 3
PREAMBLE = struct.Struct("<QQ32s")  # JSON length, tokenizer length, sha256 of both
MAX_SECTION = 1 << 28  # bytes of the JSON or of the tokenizer section (a 150 K vocabulary's is ~6 MB)


def identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """Which file, in which state: device, inode, size, modification and change times (GGUFFile.identity; the CUDA
    upload compares it with the file it read)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


PREFETCH_CHUNK = 8 << 20  # bytes a prefetch read asks for at once


def prefetch(path: str, start: int, stop, chunk: int = PREFETCH_CHUNK) -> int:
    """Read the file at `path` from `start` on, a chunk at a time in file order, until its end or until stop() holds
    (checked before every chunk), so that its bytes are in the page cache when they are read for real: the early
    weight upload's thread does this while it waits for the CUDA context (engine/cuda.upload_early), time that is
    otherwise idle, and stops when the context exists. On a cold page cache the disk would then work during the
    context's creation (the prepare cache's check, reading its samples unadvised, made the cold start faster that way:
    see `advise`); on a warm one it costs a copy on an idle thread. Off unless REFLEX_PREFETCH=1: on an H100
    (2026-12-05, scripts/cold_ab.py, 7 rounds, page cache warm) process start to result 405.2 ms p50 without, 410.3
    with; its cold-cache half, the case it was built for, is still to measure (scripts/device_run.sh's coldab stage).
    Returns the bytes read, 0 when off. Never raises: the upload reads the file itself either way."""
    if os.environ.get("REFLEX_PREFETCH", "0") != "1":
        return 0
    done = 0
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            buf = bytearray(chunk)
            while not stop():
                n = f.readinto(buf)  # the GIL released while the disk works
                if not n:
                    break
                done += n
    except (OSError, ValueError):  # gone, unreadable, a bad offset: the upload meets it and says so
        pass
    return done


def advise(mm, ranges) -> None:
    """Ask for the (start, length) ranges of the read-only mapping `mm` all at once (madvise WILLNEED), before they
    are read one after another. Off unless REFLEX_READAHEAD=1 (comparisons): on an H200 host with the 0.6B shape out
    of the page cache it made the prepare cache's check fast (open 288 -> 42 ms) but the whole cold start slower,
    process start to result 464 -> 575 ms p50 of 7 (2026-12-05, scripts/cold_ab.py): unasked, the check's own faults
    read the file while the CUDA context is being created, and the upload then finds it cached (126 against 251 ms).
    With the page cache warm it changed nothing (351 against 352 ms). Asked for a whole tensor-data section at
    process start (posix_fadvise WILLNEED, 378 MB), it slowed the upload reading the same bytes, 136 -> 230 ms.
    Advice only: never raises."""
    if os.environ.get("REFLEX_READAHEAD", "0") != "1" or not hasattr(mm, "madvise"):
        return
    import mmap

    page, size = mmap.PAGESIZE, len(mm)
    for start, length in ranges:
        try:
            lo = start - start % page
            if length <= 0 or not 0 <= lo < size:
                continue
            mm.madvise(mmap.MADV_WILLNEED, lo, min(length + start - lo, size - lo))
        except Exception:  # OSError, ValueError, OverflowError, TypeError: advice only, the next range may still go
            continue


def cache_path(model_path: str) -> str:
    return model_path + ".reflex-cache"


def tentative_json(raw: bytes) -> dict:
    """The cache's JSON read before its digest is checked: {} if unreadable (its errors are raised, if the digest
    holds, by the strict read after it)."""
    try:
        header = json.loads(raw)
    except Exception:  # ValueError, RecursionError, ...: the digest decides what the cache is worth
        return {}
    return header if isinstance(header, dict) else {}


def cached_data_span(model_path: str) -> tuple[int, int] | None:
    """(data offset, file size) of the model as its cache records them, read tentatively (preamble and JSON only, the
    digest unchecked): what the weight upload may start from on the CUDA context's thread before the model is opened
    (engine/cuda/upload.py, early). Whoever takes that upload checks it against the opened file, so a wrong answer
    here costs a discarded copy, never a wrong weight. None when there is no readable cache or it disagrees with the
    file's size."""
    try:
        with open(cache_path(model_path), "rb") as f:
            head = f.read(len(MAGIC) + PREAMBLE.size)
            if not head.startswith(MAGIC) or len(head) < len(MAGIC) + PREAMBLE.size:
                return None
            n_json = PREAMBLE.unpack_from(head, len(MAGIC))[0]
            if n_json > MAX_SECTION:
                return None
            header = tentative_json(f.read(n_json))
        size = os.path.getsize(model_path)
    except OSError:
        return None
    offset, model = header.get("data_offset"), header.get("model")
    if type(offset) is not int or not 0 < offset <= size or not isinstance(model, dict) or model.get("size") != size:
        return None
    return offset, size
