"""What one dependency between decode stages costs on this GPU: a launch boundary (plain, or programmatic dependent
launch) against a grid-wide barrier inside one persistent launch (bench/sync_cost.cu). The bound on what a
persistent decode kernel could save: (boundary - barrier) x the step's launches.

    python scripts/sync_cost.py [--stages 168] [--samples 20]

Each stage reads the whole previous stage's output (as a matvec reads x) and writes one word a block, so a stage
costs a dependency plus one L2 round trip. Builds the benchmark with nvcc for this GPU (not the engine's kernels),
times graphs of the launches as scripts/bench_gemm.py does, and prints a markdown table: median and range of the
samples, microseconds a stage.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_gemm import time_launch  # noqa: E402

from engine.cuda import driver, memory  # noqa: E402
from engine.cuda.memory import DeviceArray  # noqa: E402


def build(arch: str, out: str) -> str:
    subprocess.run(["nvcc", "-O3", "-std=c++17", "--fatbin", f"-arch={arch}", "-I", os.path.join(ROOT, "kernels"),
                    os.path.join(ROOT, "bench", "sync_cost.cu"), "-o", os.path.join(out, "sync_cost.fatbin")],
                   check=True)  # fmt: skip
    return out


def probe(launches: list[driver.Launch], buf: DeviceArray, nb: int, stream: int) -> None:
    """One untimed run over a poisoned buffer (row 0 zeros, the rest NaN), then every row checked: stage s holds s."""
    buf.fill_byte(0xFF)
    buf.view(0, (nb,)).fill_byte(0)
    for launch in launches:
        launch(stream)
    memory.synchronize(stream)
    rows = buf.to_host().reshape(-1, nb)
    want = np.arange(rows.shape[0], dtype=np.float32)[:, None]
    if not np.array_equal(rows, np.broadcast_to(want, rows.shape)):
        bad = int(np.argmax(np.any(rows != want, axis=1)))
        raise SystemExit(f"wrong result: stage {bad} holds {rows[bad, :4]}, not {bad}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=168, help="dependent stages (the 0.6B step: 28 layers x 6)")
    p.add_argument("--samples", type=int, default=20)
    args = p.parse_args()
    driver.start_context(0)
    info = driver.device_info(0)
    sms = driver.attribute(16)  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    with tempfile.TemporaryDirectory() as tmp:
        mod = driver.Module("sync_cost", build(info["arch"], tmp))
    stream = memory.stream_create()
    S = args.stages
    rows = []
    for nb in (sms, 4 * sms):
        buf = DeviceArray.empty(((S + 1) * nb,))
        for pdl in (False, True):
            if pdl and not driver.pdl_enabled():
                continue
            step = mod.fn("chain_step")
            launches = [driver.Launch(step, (nb,), (256,), [driver.ptr(buf), driver.i32(s), driver.i32(nb)])
                        for s in range(1, S + 1)]  # fmt: skip
            if pdl:
                driver.programmatic(launches)
            probe(launches, buf, nb, stream)
            us = [ms * 1e3 / S for ms in time_launch(launches, stream, args.samples)]
            rows.append((f"a launch a stage{', programmatic' if pdl else ''}", nb, us))
        buf.free()
    buf = DeviceArray.empty(((S + 1) * sms,))
    bar = DeviceArray.empty((3,), "u4")  # count, gen, failed
    bar.fill_byte(0)
    launch = driver.Launch(mod.fn("chain_persistent"), (sms,), (256,),
                           [driver.ptr(buf), driver.i32(S), driver.ptr(bar)])  # fmt: skip
    probe([launch], buf, sms, stream)
    if bar.to_host()[2]:
        raise SystemExit("a grid barrier timed out: the persistent grid was not all resident")
    us = [ms * 1e3 / S for ms in time_launch(launch, stream, args.samples)]
    rows.append(("one launch, a grid barrier a stage", sms, us))
    print(f"{info['name']} ({info['arch']}, {sms} SMs), {S} stages, median of {args.samples} samples\n")
    print("| dependency | blocks | us a stage | min-max |")
    print("|---|---|---|---|")
    for name, nb, us in rows:
        print(f"| {name} | {nb} | {statistics.median(us):.3f} | {min(us):.3f}-{max(us):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
