"""Why each kernel's warps waited: the stall reasons of an Nsight Compute raw CSV report, one row a launch (or a kernel
name, the median of its launches), in cycles a warp spent in each state per instruction it issued, the largest first.
Next to scripts/ncu_table.py (how busy a kernel kept the SMs and DRAM), this says which latency a latency-bound
kernel waits on: long_scoreboard (global / L1 loads), wait (fixed-latency dependencies), short_scoreboard (shared
memory, special functions), math_pipe_throttle, not_selected (another warp was ready: issue-bound), and so on.

    ncu --launch-count 8 -k regex:tcmv --section WarpStateStats --page raw --csv \\
        python3 -m engine profile MODEL --repeats 2 --batch 13 --prompt-tokens 1 > ncu_raw.csv
    python scripts/ncu_stalls.py ncu_raw.csv [--by-kernel] [--top 6]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

PREFIX, SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def read(path: str) -> tuple[list[str], list[tuple[str, dict[str, float]]]]:
    """The stall reasons the report holds and, a launch a row, (kernel, {reason: cycles an issued instruction})."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = next((i for i, r in enumerate(rows) if r[0] == "ID"), None)
    if head is None:
        raise ValueError(f"{path}: no raw-page CSV header (ncu --page raw --csv)")
    names = rows[head]
    ours = [(n, j) for j, n in enumerate(names) if n.startswith(PREFIX) and n.endswith(SUFFIX)]
    cols = {n[len(PREFIX) : -len(SUFFIX)]: j for n, j in ours}
    if not cols:
        raise ValueError(f"{path}: no stall metrics (collect --section WarpStateStats)")
    kernel = names.index("Kernel Name")
    launches = []
    for r in rows[head + 2 :]:  # the row after the header holds the units
        if len(r) == len(names):
            launches.append((r[kernel], {k: float(r[j].replace(",", "") or 0) for k, j in cols.items()}))
    return sorted(cols), launches


def by_kernel(launches: list[tuple[str, dict[str, float]]]) -> list[tuple[str, dict[str, float]]]:
    """One row a kernel name, in first-seen order: the median of its launches, reason by reason."""
    groups: dict[str, list[dict[str, float]]] = {}
    for name, stalls in launches:
        groups.setdefault(name, []).append(stalls)
    return [(n, {k: statistics.median(s[k] for s in g) for k in g[0]}) for n, g in groups.items()]


def table(launches: list[tuple[str, dict[str, float]]], top: int) -> str:
    out = ["| kernel | cycles a warp per issued instruction | largest stall reasons |", "|---|---|---|"]
    for name, stalls in launches:
        ranked = sorted(stalls.items(), key=lambda kv: -kv[1])[:top]
        out.append(f"| {name} | {sum(stalls.values()):.2f} | " + ", ".join(f"{k} {v:.2f}" for k, v in ranked) + " |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="ncu --page raw --csv output")
    p.add_argument("--by-kernel", action="store_true", help="one row a kernel name (median of its launches)")
    p.add_argument("--top", type=int, default=6, help="reasons a row lists")
    args = p.parse_args()
    try:
        _, launches = read(args.report)
    except (OSError, ValueError) as e:
        print(f"ncu_stalls: {e}", file=sys.stderr)
        return 1
    print(table(by_kernel(launches) if args.by_kernel else launches, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
