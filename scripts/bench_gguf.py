"""Reader and prepare-cache timings on this machine, as a markdown table (medians over fresh runs).

    python scripts/bench_gguf.py [--runs 7]

1. Opening a GGUF and reading all metadata: engine.gguf.read vs gguf-py's GGUFReader, on the real Qwen3
   vocabulary (151,936 tokens + 151,387 merges) and, when installed, the SmolLM2-135M file.
2. What `python -m engine prepare` saves at load: model open + tokenizer build, with and without the cache.
Each measurement runs in a fresh interpreter so no run warms the next one's Python objects.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "qwen3-vocab.gguf")

READ = """
import sys, time
t0 = time.perf_counter()
if sys.argv[1] == "ours":
    from engine import gguf
    f = gguf.read(sys.argv[2]); n = len(f.metadata)
else:
    import gguf
    r = gguf.GGUFReader(sys.argv[2]); n = len([f.contents() for f in r.fields.values()])
print((time.perf_counter() - t0) * 1000)
"""

OPEN = """
import sys, time
from engine.prepare import open_model
from engine.text.tokenizer import Tokenizer
t0 = time.perf_counter()
m = open_model(sys.argv[1])
tok = m.tokenizer or Tokenizer.from_gguf(m.file)
assert m.cache_used == (sys.argv[2] == "cached")
print((time.perf_counter() - t0) * 1000)
"""


def fresh(code: str, *args: str) -> float:
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(p.stdout.strip().splitlines()[-1])


def median_ms(runs: int, code: str, *args: str) -> float:
    return statistics.median(fresh(code, *args) for _ in range(runs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from engine.bundled import default_model_path
    from engine.prepare import write_cache

    files = [VOCAB]
    with contextlib.suppress(Exception):  # SmolLM2 is optional here
        files.append(default_model_path())
    print("| file | engine.gguf.read | gguf.GGUFReader | speed-up |")
    print("|---|---|---|---|")
    for path in files:
        ours = median_ms(args.runs, READ, "ours", path)
        theirs = median_ms(max(3, args.runs // 2), READ, "gguf-py", path)
        print(f"| {os.path.basename(path)} | {ours:.1f} ms | {theirs:.0f} ms | {theirs / ours:.0f}x |")
    print()
    print("| file | open + tokenizer, no cache | with prepare cache |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:
            copy = os.path.join(tmp, os.path.basename(path))
            shutil.copy(path, copy)
            parsed = median_ms(args.runs, OPEN, copy, "parsed")
            write_cache(copy)
            cached = median_ms(args.runs, OPEN, copy, "cached")
            print(f"| {os.path.basename(path)} | {parsed:.0f} ms | {cached:.0f} ms |")
    print(json.dumps({"python": sys.version.split()[0], "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
