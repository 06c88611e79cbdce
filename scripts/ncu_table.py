"""One line a kernel launch from an Nsight Compute text report: how busy it kept the SMs and DRAM, how often its
schedulers issued, its occupancy and registers. Decide with it whether a decode kernel waits on memory, on its own
instruction stream or on a chain of round trips before changing it.

    ncu --launch-skip 40 --launch-count 34 -k regex:'matvec|moe_|attn' --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        python3 -m engine profile MODEL --repeats 2 > ncu.txt
    python scripts/ncu_table.py ncu.txt [--by-kernel]

Prints a Markdown table, one row a launch in report order, or with --by-kernel one row a kernel name with the median
of its launches. ncu replays each kernel alone with its clocks locked, so durations are longer than inside a decode
step (engine profile --ablate measures those); the ratios are what this table is for.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass

# (column, ncu metric name) in the order printed
METRICS = [
    ("duration (us)", "Duration"),
    ("SM busy %", "Compute (SM) Throughput"),
    ("DRAM busy %", "DRAM Throughput"),
    ("issued / scheduler / cycle", "Issued Warp Per Scheduler"),
    ("achieved occupancy %", "Achieved Occupancy"),
    ("registers", "Registers Per Thread"),
]
# A launch's header: "  name (gx, gy, gz)x(bx, by, bz), Context 1, Stream 13, Device 0, CC 9.0"
HEADER = re.compile(r"^  (\w+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)")
# A metric line: "    Name    unit    1,234.5" (the unit may be missing)
METRIC = re.compile(r"^\s{4}(\S.*?)\s{2,}(?:\S+\s+)?([\d,]+(?:\.\d+)?)\s*$")


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    metrics: dict[str, float]


def parse(lines: list[str]) -> list[Launch]:
    """The launches of an ncu text report, each with the metrics of METRICS it reported (first value of a name)."""
    launches: list[Launch] = []
    wanted = {name for _, name in METRICS}
    for line in lines:
        h = HEADER.match(line)
        if h:
            g = tuple(int(v) for v in h.groups()[1:])
            launches.append(Launch(h.group(1), g[:3], g[3:], {}))  # type: ignore[arg-type]
            continue
        m = METRIC.match(line)
        if m and launches and m.group(1) in wanted:
            launches[-1].metrics.setdefault(m.group(1), float(m.group(2).replace(",", "")))
    return launches


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def table(launches: list[Launch], by_kernel: bool = False) -> str:
    """Markdown: a row a launch, or (by_kernel) a row a kernel name, in order of first launch, with the median of each
    metric over its launches and the launch count."""
    head = ["kernel", "grid", *(c for c, _ in METRICS)] + (["launches"] if by_kernel else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups: dict[str, list[Launch]] = {}
    for launch in launches:
        groups.setdefault(launch.kernel if by_kernel else f"{len(groups)}", []).append(launch)
    for group in groups.values():
        first = group[0]
        grid = " x ".join(str(v) for v in first.grid if v > 1) or "1"
        cells = []
        for _, name in METRICS:
            values = [launch.metrics[name] for launch in group if name in launch.metrics]
            cells.append(_cell(round(statistics.median(values), 2) if values else None))
        rows.append("| " + " | ".join([first.kernel, grid, *cells] + ([str(len(group))] if by_kernel else [])) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="ncu's text output (stdout of an ncu run with the sections above)")
    p.add_argument("--by-kernel", action="store_true", help="one row a kernel name: the median of its launches")
    args = p.parse_args(argv)
    with open(args.report, encoding="utf-8", errors="replace") as f:
        launches = parse(f.read().splitlines())
    if not launches:
        print(f"{args.report}: no kernel launches found (an ncu text report with --section output?)", file=sys.stderr)
        return 1
    print(table(launches, args.by_kernel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
