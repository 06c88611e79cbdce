"""Print the measured agreement with the llama.cpp fixtures, one row per fixture, for a backend.

python scripts/conformance_report.py [--backend cpu|cuda] [names...]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from engine.engine import Engine
from tests import conformance as C


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("names", nargs="*", default=C.TINY + C.TINY_FAMILIES)
    args = ap.parse_args()
    print("| fixture | ids | max abs vs exact math (prompt) | decode-path steps | vs llama.cpp | greedy ids |")
    print("|---|---|---|---|---|---|")
    for name in args.names:
        engine = Engine.load(C.fixture_path(name, ".gguf"), backend=args.backend, max_seq_len=512)
        m = C.measure(engine, name)
        greedy = sum(C.greedy_agrees(o, w, g, m.max_abs_prompt) for o, w, g in m.greedy)
        print(f"| {name} | {'same' if m.prompt_ids_match else 'DIFFER'} | {m.max_abs_prompt:.2e} | "
              f"{m.max_abs_steps:.2e} | {m.max_abs_llamacpp:.2e} | {greedy}/{len(m.greedy)} agree |")  # fmt: skip


if __name__ == "__main__":
    main()
