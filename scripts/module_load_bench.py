"""How long cuModuleLoad takes per kernel module, for one or more kernel builds (e.g. ./build_kernels.sh's default
with -lineinfo against a LINEINFO=0 release build), each load in a fresh process with its own context, builds
alternating round by round. Needs a GPU.

    python scripts/module_load_bench.py kernels/build /tmp/build-release --rounds 5 [--modules matvec,attention]

Prints a markdown table: per module, the fatbin's size and the median load time in each build; then the sum over
the modules a dense model loads (engine/cuda.BASE_MODULES, or --modules).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import json, sys, time
from engine.cuda import driver
driver.start_context(0)
out = {}
for name in sys.argv[2].split(","):
    t0 = time.perf_counter()
    driver.Module(name, sys.argv[1])
    out[name] = (time.perf_counter() - t0) * 1000.0
print(json.dumps(out))
"""


def main() -> None:
    sys.path.insert(0, ROOT)
    from engine.cuda import BASE_MODULES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", help="kernel build directories")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modules", default=",".join(BASE_MODULES))
    args = ap.parse_args()
    names = args.modules.split(",")
    ms: dict[str, dict[str, list[float]]] = {b: {n: [] for n in names} for b in args.builds}
    for _ in range(args.rounds):
        for build in args.builds:
            p = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(build), ",".join(names)], cwd=ROOT,
                               capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
            for name, t in json.loads(p.stdout.strip().splitlines()[-1]).items():
                ms[build][name].append(t)
    print("| module | " + " | ".join(f"{b}: MB, ms" for b in args.builds) + " |")
    print("|---" * (len(args.builds) + 1) + "|")
    totals = {b: 0.0 for b in args.builds}
    for name in names:
        cells = []
        for build in args.builds:
            med = statistics.median(ms[build][name])
            totals[build] += med
            size = os.path.getsize(os.path.join(build, name + ".fatbin")) / 1e6
            cells.append(f"{size:.1f}, {med:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| sum of medians | " + " | ".join(f"{totals[b]:.1f} ms" for b in args.builds) + " |")


if __name__ == "__main__":
    main()
