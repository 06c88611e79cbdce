"""Time shapes of matvec_stream (bench/stream_variants.cu) on the LM head shapes, one GPU, median of repeats.

    python scripts/stream_bench.py [--repeats 50] > bench/results/DATE-stream.json

Builds the variants with nvcc for the GPU's arch (a benchmark, not the engine: the engine loads only
./build_kernels.sh's modules) and launches them through CuPy on random weight bytes (timing does not depend on
the values) with a random x; prints JSON: per (shape, variant) the median microseconds and the weight GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import cupy as cp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "bench", "stream_variants.cu")
BYTES = {"q6": (256, 210), "q8": (32, 34), "q4": (256, 144)}  # values and bytes a block
SHAPES = [(151936, 2048), (151936, 1024), (248320, 1024)]  # Qwen3-30B-A3B, Qwen3-0.6B, Qwen3.5-0.8B LM heads


def build(arch: str) -> str:
    out = os.path.join(tempfile.mkdtemp(), "stream_variants.cubin")
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-cubin", f"-arch={arch}", "-I", os.path.join(ROOT, "kernels"), SRC,
                    "-o", out], check=True)  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    major, minor = cp.cuda.Device().compute_capability
    mod = cp.RawModule(path=build(f"sm_{major}{minor}"))
    with open(SRC) as f:
        names = re.findall(r"^VARIANT\((\w+),", f.read(), re.M)
    rng = np.random.default_rng(0)
    results = []
    for rows, cols in SHAPES:
        x = cp.asarray(rng.normal(size=cols).astype(np.float32))
        nw = cp.asarray((1 + 0.1 * rng.normal(size=cols)).astype(np.float32))
        y = cp.empty(rows, cp.float32)
        for name in names:
            qk, nb = BYTES[name[:2]]
            w_, r_ = (int(v) for v in re.match(r"\w\w_w(\d+)_r(\d+)", name).groups())
            g = int(re.search(r"_g(\d+)", name).group(1))
            if cols > 256 * g:
                continue
            row_bytes = cols // qk * nb
            w = cp.asarray(rng.integers(0, 256, size=rows * row_bytes + 16, dtype=np.uint8))
            fn = mod.get_function(name)
            grid, block = ((rows + w_ * r_ - 1) // (w_ * r_),), (32 * w_,)
            argv = (w, np.int64(row_bytes), np.int32(rows), np.int32(cols), x, nw, np.float32(1e-6), np.uint64(0), y)
            for _ in range(3):
                fn(grid, block, argv)
            times = []
            for _ in range(args.repeats):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record()
                fn(grid, block, argv)
                b.record()
                b.synchronize()
                times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
            us = float(np.median(times))
            results.append({"rows": rows, "cols": cols, "variant": name, "us": round(us, 2),
                            "gb_per_s": round(rows * row_bytes / us / 1e3, 1)})  # fmt: skip
            print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
