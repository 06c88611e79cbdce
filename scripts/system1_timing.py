"""Warm system1 calls on one model, timed: the p50 and minimum of N calls after a warm-up, with the last call's
timings, as one JSON line. For A/Bs of host-side changes, run it from two checkouts in turn, interleaved
(PYTHONPATH=CHECKOUT); `engine bench` times the same call 20 times among everything else.

    python scripts/system1_timing.py MODEL [--calls 300] [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine.engine import Engine
from engine.tools.bench import CANDIDATES, SYSTEM1_PROMPT


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--label", default="")
    args = p.parse_args()
    engine = Engine.load(args.model)
    for _ in range(args.warmup):
        engine.system1(SYSTEM1_PROMPT, CANDIDATES)
    ms = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        result = engine.system1(SYSTEM1_PROMPT, CANDIDATES)
        ms.append((time.perf_counter() - t0) * 1000.0)
    print(json.dumps({"label": args.label, "backend": engine.backend, "calls": args.calls,
                      "p50_ms": round(statistics.median(ms), 4), "min_ms": round(min(ms), 4),
                      "timings": result["timings"]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
