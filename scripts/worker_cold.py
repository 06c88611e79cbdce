"""Cold starts of the Runpod worker beside the bare engine: N fresh worker processes and N fresh
`python -m engine system1` processes on the same model and job, alternating; p50 / p95 of each process's own
cold-start record and of the wall clock seen from outside.

    python scripts/worker_cold.py MODEL.gguf [--runs 5] [--backend cuda] [--queue stdlib|sdk|both]

Without --queue the worker is `handler.py --test_input` (the SDK's local test mode runs one job and exits). With
--queue it is `python handler.py` in the platform's queue mode against a fake Runpod platform on loopback
(engine/tools/fake_runpod.py) holding the job, through our job loop (`stdlib`), the SDK's (`sdk`, REFLEX_JOB_LOOP=sdk)
or both in turn; there `external_first_take_ms` is spawn → the first job-take request and `external_wall_ms` spawn
→ the result's arrival, as the platform sees them (elsewhere `external_wall_ms` is spawn → exit).

Prints one JSON report. The worker's record has the SDK phases (`runpod_import_ms`, `runpod_import_wait_ms`,
`process_start_to_worker_ready_ms`, `process_start_to_first_job_ms`) beside the engine's.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.tools import bench  # noqa: E402
from engine.tools.fake_runpod import FakeRunpod  # noqa: E402

PROMPT = "Question: is the sky blue on a clear day? Answer:"
CANDIDATES = [" yes", " no", " maybe"]
_RESULT = "Job result: "


def _summary(values: list[float]) -> dict:
    s = sorted(values)
    return {"p50": round(statistics.median(s), 1), "p95": round(s[min(len(s) - 1, round((len(s) - 1) * 0.95))], 1),
            "min": round(s[0], 1), "n": len(s)}  # fmt: skip


def _worker(model: str, env: dict) -> tuple[dict, float]:
    job = json.dumps({"input": {"prompt": PROMPT, "candidates": CANDIDATES}})
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "handler.py", "--test_input", job], capture_output=True, text=True, cwd=ROOT,
                       env={**env, "MODEL_PATH": model}, timeout=600)  # fmt: skip
    wall = (time.perf_counter() - t0) * 1000.0
    for line in (p.stdout + p.stderr).splitlines():
        if _RESULT in line:  # the SDK logs the job's result as a Python literal
            output = ast.literal_eval(line.split(_RESULT, 1)[1])["output"]
            output = output[0] if isinstance(output, list) else output
            if "error" in output:
                break
            return output["cold_start"], wall
    raise RuntimeError(f"worker run failed (exit {p.returncode}): {(p.stdout + p.stderr)[-1500:]}")


def _queue_worker(model: str, env: dict, loop: str) -> tuple[dict, float, dict]:
    job = {"id": "cold", "input": {"prompt": PROMPT, "candidates": CANDIDATES}}
    with FakeRunpod([job]) as platform:
        worker_env = {**env, **platform.worker_env(), "MODEL_PATH": model, "REFLEX_JOB_LOOP": loop}
        t0 = time.monotonic()  # the clock the platform stamps requests with
        proc = subprocess.Popen([sys.executable, "handler.py"], cwd=ROOT, env=worker_env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            platform.wait_for(lambda: "cold" in platform.results, 600, alive=lambda: proc.poll() is None)
        finally:
            proc.terminate()
            err = proc.communicate(timeout=60)[1]
    result = platform.results.get("cold", {})
    if "output" not in result:
        raise RuntimeError(f"queue worker failed ({result or 'no result'}): {err[-1500:]}")
    (output,) = result["output"]
    first_take_ms = (platform.of_kind("take")[0].t - t0) * 1000.0
    result_ms = (platform.of_kind("done")[0].t - t0) * 1000.0
    return output["cold_start"], result_ms, {"external_first_take_ms": first_take_ms}


def _engine(model: str, env: dict, backend: str | None) -> tuple[dict, float]:
    result, wall = bench.run_cli(bench.system1_argv(model, PROMPT, CANDIDATES, backend), env, cwd=ROOT)
    return result["cold_start"], wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--backend", default=None)
    ap.add_argument(
        "--queue",
        choices=("stdlib", "sdk", "both"),
        default=None,
        help="queue mode against a fake platform, through this job loop (default: --test_input mode)",
    )
    args = ap.parse_args(argv)
    bench.compile_bytecode()  # the engine's bytecode, as the worker image's build writes it
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.backend:
        env["REFLEX_BACKEND"] = args.backend
    kinds = {"worker": lambda: (*_worker(args.model, env), {})}
    if args.queue:
        loops = ("stdlib", "sdk") if args.queue == "both" else (args.queue,)
        kinds = {f"worker_queue_{loop}": (lambda loop=loop: _queue_worker(args.model, env, loop)) for loop in loops}
    kinds["engine"] = lambda: (*_engine(args.model, env, args.backend), {})
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in kinds}
    for _ in range(args.runs):
        for name, fn in kinds.items():
            record, wall, external = fn()
            for k, v in {**record, **external}.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    runs[name].setdefault(k, []).append(float(v))
            runs[name].setdefault("external_wall_ms", []).append(wall)
    report = {"date": time.strftime("%Y-%m-%d"), "model": os.path.basename(args.model), "runs": args.runs,
              "command": " ".join(sys.argv)}  # fmt: skip
    report |= {name: {k: _summary(v) for k, v in phases.items()} for name, phases in runs.items()}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
