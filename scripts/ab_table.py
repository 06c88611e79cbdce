"""An A/B run's numbers as one table: every `engine profile` and `engine bench` JSON under a results directory (the
variants stage's variant_{profile,bench}_FORM[_bN]_ROUND.json, or any NAME_ROUND.json a run script wrote), a row per
file stem without its round, a column per round.

    python scripts/ab_table.py /tmp/r/fold            # Markdown table on stdout

Profiles give their step (ms) and launches a step; benches their warm decode and pp512 / pp16 (tok/s) and system1
p50 (ms). A file that holds an error or no JSON shows the error's first words.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROUND = re.compile(r"^(?P<stem>.+)_(?P<round>\d+)$")


def measures(d: dict) -> str:
    """The figures of one profile or bench report, or its error."""
    if "error" in d:
        return "error: " + str(d["error"])[:60]
    if "step_ms" in d:
        return f"step {d['step_ms']} ms, {d['launches_per_step']} launches"
    w = d.get("warm")
    if not w:
        return "no figures"
    return (f"decode {w['decode']['tokens_per_s']}, pp512 {w['prefill_512']['tokens_per_s']}, "
            f"pp16 {w['prefill_16']['tokens_per_s']} tok/s, system1 {w['system1_ms']['p50']} ms")  # fmt: skip


def read(path: Path) -> str:
    try:
        return measures(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable: {type(e).__name__}"


def table(root: Path) -> str:
    rows: dict[str, dict[int, str]] = {}
    for path in sorted(root.rglob("*.json")):
        m = ROUND.match(path.stem)
        if m is None:
            continue
        rows.setdefault(str(path.parent.relative_to(root) / m["stem"]), {})[int(m["round"])] = read(path)
    rounds = sorted({r for by in rows.values() for r in by})
    out = ["| run | " + " | ".join(f"round {r}" for r in rounds) + " |", "|---" * (len(rounds) + 1) + "|"]
    out += [f"| {name} | " + " | ".join(by.get(r, "") for r in rounds) + " |" for name, by in sorted(rows.items())]
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python scripts/ab_table.py RESULTS_DIR")
    print(table(Path(sys.argv[1])))
