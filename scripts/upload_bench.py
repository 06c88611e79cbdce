"""The CUDA weight upload of one GGUF alone, for a lock-thread count and a piece size (engine/cuda/upload.py).

    python scripts/upload_bench.py MODEL THREADS PIECE_MIB

Prints one JSON line: the setting, the upload's wall time and DeviceWeights.stats. Run each setting in a fresh
process (the CUDA context and the page cache are then as a cold worker sees them, once the file was read once).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine import gguf
from engine.cuda import memory, upload
from engine.cuda.context import ContextStarter


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    path, threads, piece_mib = argv[0], int(argv[1]), int(argv[2])
    os.environ["REFLEX_UPLOAD_THREADS"] = str(threads)
    upload.CHUNK_BYTES = piece_mib << 20
    ContextStarter(0).wait()
    gf = gguf.read(path)
    stream = memory.stream_create()
    start = time.perf_counter()
    weights = upload.DeviceWeights(gf, stream)
    wall_ms = (time.perf_counter() - start) * 1e3
    stats = {k: round(v, 1) if isinstance(v, float) else v for k, v in weights.stats.items()}
    print(json.dumps({"threads": threads, "piece_mib": piece_mib, "wall_ms": round(wall_ms, 1), **stats}))


if __name__ == "__main__":
    main(sys.argv[1:])
