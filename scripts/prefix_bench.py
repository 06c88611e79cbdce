"""The build-time prefix cache's effect on system1: a ~1,000-token shared system prompt baked beside the model
(`python -m engine prepare MODEL --prefix TEXT`) against the same file without it (a hard link of another name, so
no prefix state sits beside it), cold (fresh processes, interleaved) and warm (in this process).

    python scripts/prefix_bench.py MODEL.gguf [--prefix-tokens 1000] [--runs 5] [--repeats 20] [--backend cuda]

Prints one JSON report: per side, p50 / p95 of each cold process's `process_start_to_result_ms`, `prompt_eval_ms`
and outside wall clock, `prefix_tokens_reused`, and the warm system1 latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.tools import bench  # noqa: E402

SENTENCE = "The support assistant answers questions about orders, refunds and shipping politely and briefly. "
QUESTION = "Question: is a refund possible after thirty days? Answer:"
CANDIDATES = [" yes", " no", " maybe"]


def _summary(values: list[float]) -> dict:
    s = sorted(values)
    return {"p50": round(statistics.median(s), 2), "p95": round(s[min(len(s) - 1, round((len(s) - 1) * 0.95))], 2),
            "n": len(s)}  # fmt: skip


def system_prompt(model: str, n_tokens: int) -> str:
    """Whole sentences up to about n_tokens tokens, ending in a newline (so the question starts a new word)."""
    from engine.prepare import open_model
    from engine.text.tokenizer import Tokenizer

    opened = open_model(model)
    tok = opened.tokenizer or Tokenizer.from_gguf(opened.file)
    text = "System: "
    while len(tok.encode(text + SENTENCE)) < n_tokens:
        text += SENTENCE
    return text.rstrip() + "\n"


def _cold(model: str, prompt: str, backend: str | None, env: dict) -> dict:
    result, wall = bench.run_cli(bench.system1_argv(model, prompt, CANDIDATES, backend), env, cwd=ROOT)
    cold, timings = result["cold_start"], result["timings"]
    return {"process_start_to_result_ms": cold["process_start_to_result_ms"],
            "prompt_eval_ms": timings["prompt_eval_ms"], "prefix_tokens_reused": timings.get("prefix_tokens_reused", 0),
            "external_wall_ms": wall}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backend", default=None)
    args = ap.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    baked = os.path.abspath(args.model)
    plain = baked.removesuffix(".gguf") + ".no-prefix.gguf"
    if not os.path.exists(plain):
        os.link(baked, plain)
    prefix = system_prompt(baked, args.prefix_tokens)
    prompt = prefix + QUESTION
    py = [sys.executable, "-m", "engine", "prepare"]
    extra = ["--backend", args.backend] if args.backend else []
    for cmd in ([*py, baked, "--prefix", prefix, *extra], [*py, plain]):
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env=env, timeout=600)

    runs: dict[str, dict[str, list[float]]] = {"prefix": {}, "no_prefix": {}}
    for _ in range(args.runs):
        for side, model in (("prefix", baked), ("no_prefix", plain)):
            for k, v in _cold(model, prompt, args.backend, env).items():
                runs[side].setdefault(k, []).append(float(v))
    report: dict = {"date": time.strftime("%Y-%m-%d"), "model": os.path.basename(baked), "command": " ".join(sys.argv)}
    from engine.engine import Engine

    for side, model in (("prefix", baked), ("no_prefix", plain)):
        engine = Engine.load(model, backend=args.backend)
        report["prompt_tokens"] = len(engine.tokenizer.encode(prompt))
        for _ in range(3):
            engine.system1(prompt, CANDIDATES)
        warm = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.system1(prompt, CANDIDATES)
            warm.append((time.perf_counter() - t0) * 1000.0)
        report[side] = {k: _summary(v) for k, v in runs[side].items()} | {"warm_system1_ms": _summary(warm)}
        del engine
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
