"""Side by side with llama.cpp, and the meter both sides' processes run under.

`Meter.run(argv)` runs one fresh process and reads, from outside it, its wall clock (spawn to exit), the GPU memory
it added at its peak and the GPU energy it took (NVML through nvidia-ml-py; both `None` without a GPU or NVML).
`LlamaCpp(bin_dir)` drives a llama.cpp build on the same file: `llama-simple -n 1` for a cold first token (its own
load / prompt-eval phases parsed from its log) and `llama-bench` for pp512 and tg128 with flash attention off and on.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass

from engine.errors import InvalidInput

POLL_S = 0.005  # NVML memory poll while a process runs


@dataclass
class ProcessRun:
    wall_ms: float
    returncode: int
    stdout: str
    stderr: str
    peak_vram_mib: float | None  # device memory in use at the peak, less what was in use before the spawn
    energy_j: float | None  # the device's total-energy counter across the run


class Meter:
    """NVML readings for device `index`, or none (every reading `None`) when NVML or a GPU is missing."""

    def __init__(self, index: int = 0):
        self.nvml = self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
        except Exception:  # no package, no driver, no device: readings stay None
            pass

    def _used_mib(self) -> float:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20

    def _energy_j(self) -> float | None:
        try:
            return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0
        except Exception:  # counter not supported on this device
            return None

    def idle_watts(self, seconds: float = 2.0) -> float | None:
        """Mean board power over `seconds` of doing nothing (energy counter delta / time)."""
        if self.nvml is None or (e0 := self._energy_j()) is None:
            return None
        t0 = time.perf_counter()
        time.sleep(seconds)
        return round((self._energy_j() - e0) / (time.perf_counter() - t0), 1)

    def run(self, argv: list[str], env: dict | None = None, timeout: float = 600.0) -> ProcessRun:
        base = self._used_mib() if self.nvml else None
        e0 = self._energy_j() if self.nvml else None
        peak = [base]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], self._used_mib())
                time.sleep(POLL_S)

        watcher = threading.Thread(target=poll, daemon=True) if self.nvml else None
        if watcher:
            watcher.start()
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        wall = (time.perf_counter() - t0) * 1000.0
        done.set()
        if watcher:
            watcher.join()
        e1 = self._energy_j() if e0 is not None else None
        return ProcessRun(wall, proc.returncode, out, err, None if base is None else round(peak[0] - base, 1),
                          None if e1 is None else round(e1 - e0, 3))  # fmt: skip


_PERF = re.compile(r"llama_perf_context_print:\s+(load|prompt eval|eval|total) time =\s+([\d.]+) ms")


class LlamaCpp:
    """A llama.cpp build directory (its `bin/` or the folder holding llama-simple and llama-bench)."""

    name = "llama.cpp"

    def __init__(self, build_dir: str):
        for d in (os.path.join(build_dir, "bin"), build_dir):
            if all(os.access(os.path.join(d, b), os.X_OK) for b in ("llama-simple", "llama-bench")):
                self.bin = d
                break
        else:
            raise InvalidInput(f"no llama-simple and llama-bench under {build_dir} (or its bin/)")

    def cold_argv(self, model: str, prompt: str) -> list[str]:
        return [os.path.join(self.bin, "llama-simple"), "-m", model, "-n", "1", "-ngl", "99", prompt]

    @staticmethod
    def phases(log: str) -> dict[str, float]:
        """llama-simple's own timings (ms): load, prompt eval, eval, total."""
        return {f"{k.replace(' ', '_')}_ms": float(v) for k, v in _PERF.findall(log)}

    def bench(self, model: str, repeats: int = 5) -> dict:
        """pp512 and tg128 tokens/s (mean and stddev over `repeats`), flash attention off and on."""
        out: dict = {}
        for fa in (0, 1):
            argv = [os.path.join(self.bin, "llama-bench"), "-m", model, "-p", "512", "-n", "128", "-ngl", "99",
                    "-fa", str(fa), "-r", str(repeats), "-o", "json"]  # fmt: skip
            p = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
            if p.returncode != 0:
                out[f"fa{fa}"] = {"error": p.stderr.strip().splitlines()[-3:]}
                continue
            rows = json.loads(p.stdout)
            out[f"fa{fa}"] = {("pp512" if r["n_prompt"] else "tg128"): {"tokens_per_s": round(r["avg_ts"], 1),
                              "stddev": round(r["stddev_ts"], 1)} for r in rows}  # fmt: skip
        return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def compare(report: dict) -> dict:
    """Ours vs the peer, from a bench report with a `peer` section: >1 means ours is better (faster, or less)."""
    peer, warm, cold = report["peer"], report["warm"], report.get("cold", {})
    out: dict = {}
    for fa in ("fa0", "fa1"):
        got = peer["warm"].get(fa, {})
        if "tg128" in got:
            out[f"decode_vs_{fa}"] = ratio(warm["decode"]["tokens_per_s"], got["tg128"]["tokens_per_s"])
        if "pp512" in got and "prefill_512" in warm:
            out[f"pp512_vs_{fa}"] = ratio(warm["prefill_512"]["tokens_per_s"], got["pp512"]["tokens_per_s"])
    peer_cold = peer.get("cold", {})
    for job in ("system1", "generate"):
        if job in cold and "external_wall_ms" in peer_cold:
            out[f"cold_{job}"] = ratio(peer_cold["external_wall_ms"]["p50"], cold[job]["external_wall_ms"]["p50"])
            for key in ("energy_j", "peak_vram_mib"):
                if key in cold[job] and key in peer_cold:
                    out[f"{key}_{job}"] = ratio(peer_cold[key]["p50"], cold[job][key]["p50"])
    return out
