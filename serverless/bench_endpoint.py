"""Cold vs warm latency of a live Runpod endpoint running this worker, over N invocations (requests through
client.py, i.e. the Runpod SDK's endpoint client).

    export RUNPOD_API_KEY=...
    python serverless/bench_endpoint.py ENDPOINT_ID --cold 3 --warm 10 [--input JSON] [--out bench.json]

A cold round first waits (polling /health, up to --scale-down-wait-s) until the endpoint has no worker, idle or
running — set a short idle timeout on the endpoint, e.g. 5 s — then sends one /runsync job: the platform must start
a worker for it. `--warm` more jobs follow back to back, on the worker that is now up. For every job it records the
client's round trip, the platform's delayTime (queue + worker start) and executionTime, and whether the answering
worker process was new (its first result carries `cold_start`; a FlashBoot revival can skip process start, which
then shows as a "cold" round answered by a warm process). Prints medians / p95 per class and the median of every
cold-start phase, and writes all samples to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client import call, result_of, wait  # the sibling module (this is run as a script)

DEFAULT_JOB = {"prompt": "The capital of France is", "candidates": [" Paris", " London", " Berlin"]}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def scaled_to_zero(endpoint: str, limit_s: float, poll_s: float = 5.0) -> float:
    """Wait until /health shows no worker; returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        workers = call(endpoint, "health").get("workers", {})
        if not any(workers.get(k, 0) for k in ("idle", "running", "initializing", "ready")):
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            raise SystemExit(f"the endpoint still has workers after {limit_s:.0f} s: {workers}")
        time.sleep(poll_s)


def invoke(endpoint: str, payload: dict, kind: str) -> dict:
    t0 = time.monotonic()
    job = wait(endpoint, call(endpoint, "runsync?wait=300000", {"input": payload}))
    sample = {"kind": kind, "client_ms": 1000 * (time.monotonic() - t0), "status": job.get("status"),
              "delay_ms": job.get("delayTime"), "execution_ms": job.get("executionTime"),
              "worker": job.get("workerId")}  # fmt: skip
    result = result_of(job)
    cold = result.get("cold_start") if isinstance(result, dict) else None
    sample["new_process"] = cold is not None
    sample["cold_start"] = cold
    sample["timings"] = result.get("timings") if isinstance(result, dict) else None
    print(json.dumps({k: v for k, v in sample.items() if k not in ("cold_start", "timings")}), file=sys.stderr)
    return sample


def summary(samples: list[dict]) -> dict:
    out = {}
    groups = {"cold_round": [s for s in samples if s["kind"] == "cold"],
              "warm": [s for s in samples if s["kind"] == "warm"],
              "new_process": [s for s in samples if s["new_process"]]}  # fmt: skip
    for name, group in groups.items():
        ok = [s for s in group if s["status"] == "COMPLETED"]
        row = {"n": len(group), "failed": len(group) - len(ok)}
        for metric in ("client_ms", "delay_ms", "execution_ms"):
            values = [s[metric] for s in ok if isinstance(s[metric], (int, float))]
            if values:
                row[metric] = {"p50": round(statistics.median(values), 1), "p95": round(percentile(values, 95), 1),
                               "min": round(min(values), 1), "max": round(max(values), 1)}  # fmt: skip
        out[name] = row
    phases: dict[str, list[float]] = {}
    for s in groups["new_process"]:
        for key, value in (s["cold_start"] or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                phases.setdefault(key, []).append(value)
    out["cold_start_phases_p50_ms"] = {k: round(statistics.median(v), 1) for k, v in phases.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("endpoint")
    p.add_argument("--cold", type=int, default=3, help="cold rounds (each waits for scale-to-zero first)")
    p.add_argument("--warm", type=int, default=5, help="warm jobs after each cold one")
    p.add_argument("--input", help="job input as JSON (default: a system1 job)")
    p.add_argument("--scale-down-wait-s", type=float, default=900.0)
    p.add_argument("--out", help="write every sample and the summary to this JSON file")
    args = p.parse_args(argv)
    payload = json.loads(args.input) if args.input else DEFAULT_JOB
    samples = []
    for _ in range(max(1, args.cold)):
        if args.cold > 0:
            waited = scaled_to_zero(args.endpoint, args.scale_down_wait_s)
            print(f"scaled to zero (waited {waited:.0f} s)", file=sys.stderr)
        samples.append(invoke(args.endpoint, payload, "cold" if args.cold > 0 else "warm"))
        samples += [invoke(args.endpoint, payload, "warm") for _ in range(args.warm)]
    result = {"endpoint": args.endpoint, "input": payload, "summary": summary(samples), "samples": samples}
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(s["status"] == "COMPLETED" for s in samples) else 1


if __name__ == "__main__":
    sys.exit(main())
