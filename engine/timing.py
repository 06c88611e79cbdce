"""Clocks for the cold-start breakdown: the OS process start time, and `ColdStart`, the one record of its phases.

Phases are measured against CLOCK_BOOTTIME, the clock /proc/self/stat's start time is counted in, so
`process_start_to_*` includes interpreter start-up and imports, which no Python-side timer could see.
"""

from __future__ import annotations

import os
import time


def now() -> float:
    """Seconds since boot on the clock the process start time is expressed in."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _process_start() -> float:
    """Seconds since boot at which this process started (field 22 of /proc/self/stat, in clock ticks)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # The command name (field 2) may hold spaces or parentheses: split after its closing parenthesis.
        fields = stat[stat.rindex(b")") + 2 :].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now()  # no procfs: the best available stand-in is "now", i.e. timings start at first import


PROCESS_START = _process_start()


def ms_since(t: float) -> float:
    return (now() - t) * 1000.0


def since_process_start_ms() -> float:
    return ms_since(PROCESS_START)


class Stopwatch:
    """with Stopwatch() as sw: ...; sw.ms"""

    def __enter__(self) -> Stopwatch:
        self.t0 = now()
        self.ms = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.ms = ms_since(self.t0)


def rounded(phases: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in phases.items()}


IMPORTS_DONE: float | None = None  # set by an entry point once its imports are done


def mark_imports_done() -> None:
    global IMPORTS_DONE
    IMPORTS_DONE = now()


class ColdStart(dict):
    """The cold-start record of one loaded engine: phase name -> ms (or a flag), filled by whoever measures a phase
    (the engine's load, the CUDA backend, the worker's boot) and handed out once, on the first result, by `take`.
    This is the only place the phases are merged: docs/design.md §2 lists them."""

    taken = False

    def take(self, **final: float | None) -> dict[str, float | None] | None:
        """The whole record plus the first result's own phases, rounded; None for every later result."""
        if self.taken:
            return None
        self.taken = True
        return rounded({**self, **final})
