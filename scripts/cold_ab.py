"""Cold system1 processes under several environment settings, interleaved round by round, on one machine: the
settings' cold-start phases side by side (p50 and min over the rounds), for A/Bs of the cold path's switches
(REFLEX_EARLY_UPLOAD, REFLEX_READAHEAD, REFLEX_MODULE_PRELOAD, REFLEX_UPLOAD_PIECE_MIB, REFLEX_UPLOAD_THREADS, ...).

    python scripts/cold_ab.py MODEL --rounds 7 --variant base= --variant late_upload=REFLEX_EARLY_UPLOAD=0 \\
        --variant pieces32=REFLEX_UPLOAD_PIECE_MIB=32 [--drop-page-cache] [--out ab.json]

A variant is NAME=[KEY=VALUE[,KEY=VALUE...]]. Run `python -m engine prepare MODEL` first (as the image's build does):
without the prepare cache nothing is uploaded early and the report says so. Prints a markdown table; --out writes
the per-round figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.tools.bench import (
    CANDIDATES,
    SYSTEM1_PROMPT,
    cli_result,
    compile_bytecode,
    drop_page_cache,
    system1_argv,
)
from engine.tools.peer import Meter

# The phases shown, in the order they happen on the main thread (then the thread's and the totals).
ROWS = ["imports_ms", "gguf_open_ms", "cuda_init_wait_ms", "early_upload_wait_ms", "stream_ms", "weights_alloc_ms",
        "prefetch_mib", "upload_ms", "host_register_ms", "buffers_ms", "model_load_ms", "prompt_eval_ms",
        "cuda_init_ms", "process_start_to_ready_ms", "process_start_to_result_ms", "external_wall_ms",
        "energy_j"]  # fmt: skip


def variant(spec: str) -> tuple[str, dict[str, str]]:
    name, _, settings = spec.partition("=")
    env = {}
    for item in filter(None, settings.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"variant {spec!r}: settings are KEY=VALUE, separated by commas")
        env[key] = value
    if not name:
        raise argparse.ArgumentTypeError(f"variant {spec!r} has no name")
    return name, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", type=variant, action="append", required=True)
    ap.add_argument("--drop-page-cache", action="store_true", help="every process starts with the model out of it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    compile_bytecode()
    meter = Meter()
    argv = system1_argv(args.model, SYSTEM1_PROMPT, CANDIDATES, None)
    runs: dict[str, list[dict]] = {name: [] for name, _ in args.variant}
    for _ in range(args.rounds):
        for name, env in args.variant:
            if args.drop_page_cache:
                drop_page_cache(args.model)
            r = meter.run(argv, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
            cold = cli_result(r.stdout, r.stderr, f"cold {name}")["cold_start"]
            cold.update(external_wall_ms=r.wall_ms, energy_j=r.energy_j)
            runs[name].append(cold)
    names = [name for name, _ in args.variant]
    print(f"| phase (p50 / min of {args.rounds}, ms) | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for key in ROWS:
        cells = []
        for name in names:
            values = [c[key] for c in runs[name] if type(c.get(key)) in (int, float)]
            cells.append(f"{statistics.median(values):.1f} / {min(values):.1f}" if values else "-")
        print(f"| {key} | " + " | ".join(cells) + " |")
    flags = {name: {k: sorted({str(c.get(k)) for c in runs[name]}) for k in ("early_upload", "prepare_cache_used")}
             for name in names}  # fmt: skip
    print(f"\nflags: {json.dumps(flags)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "rounds": args.rounds, "variants": dict(args.variant), "runs": runs,
                       "page_cache": "dropped" if args.drop_page_cache else "warm"}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
