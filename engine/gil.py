"""The GIL's switch interval on the cold path (REFLEX_IMPORT_SWITCH_MS; "default": Python's 5 ms).

A cold start runs Python imports on one thread beside a CUDA load on another: the weight upload on its own thread
while the main thread imports and opens the model (engine/cuda.upload_early), the model load on the main thread
while the worker's import thread imports the SDK and the job schemas (engine/worker/serverless.RunpodImport). A CUDA
load is many short ctypes / CuPy calls, each of which gives the GIL up, and taking it back from a thread that is
running Python waits up to the switch interval. On the H200 (2026-12-01, the queue worker beside the bare engine)
the load's buffers phase, nothing but such calls, took 67.6 ms instead of 4.7 with the schema imports beside it. On
the 2-core development machine, 300 calls of 0.1 ms beside these imports took 237-253 ms at 5 ms and 111-128 ms at
0.5 ms (alone: ~33 ms). So while any such overlap lasts, `hold()` keeps the interval at SWITCH_MS; the last
`release()` gives Python's back.
"""

from __future__ import annotations

import os
import sys
import threading

SWITCH_MS = 0.5

_lock = threading.Lock()
_holders = 0
_saved: float | None = None  # Python's interval while held


def interval() -> float | None:
    """The interval (s) to hold, or None to leave Python's."""
    raw = os.environ.get("REFLEX_IMPORT_SWITCH_MS", "").strip()
    if raw == "default":
        return None
    try:
        ms = float(raw) if raw else SWITCH_MS
    except ValueError:
        ms = SWITCH_MS
    return ms / 1000.0 if 0.0 < ms < 1000.0 else None


def hold() -> bool:
    """Shorten the interval until the matching release(). False (nothing to release) when the setting leaves
    Python's interval, or nobody holds and the interval is already as short."""
    global _holders, _saved
    target = interval()
    if target is None:
        return False
    with _lock:
        if _holders == 0:
            if target >= sys.getswitchinterval():
                return False
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(target)
        _holders += 1
    return True


def release() -> None:
    """End one hold(); the last gives Python's interval back."""
    global _holders, _saved
    with _lock:
        _holders -= 1
        if _holders == 0 and _saved is not None:
            sys.setswitchinterval(_saved)
            _saved = None
