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


def build(arch: str) -> str:
    out = tempfile.mkdtemp()
    subprocess.run(["nvcc", "-O3", "-std=c++17", "--fatbin", f"-arch={arch}", "-I", os.path.join(ROOT, "kernels"),
                    os.path.join(ROOT, "bench", "sync_cost.cu"), "-o", os.path.join(out, "sync_cost.fatbin")],
                   check=True)  # fmt: skip
    return out


def expected(stages: int) -> float:
    v = 0.0
    for _ in range(stages):
        v = 0.5 * v + 1.0
    return v


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=168, help="dependent stages (the 0.6B step: 28 layers x 6)")
    p.add_argument("--samples", type=int, default=20)
    args = p.parse_args()
    driver.start_context(0)
    info = driver.device_info(0)
    sms = driver.attribute(16)  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    mod = driver.Module("sync_cost", build(info["arch"]))
    stream = memory.stream_create()
    S = args.stages
    rows = []
    for nb in (sms, 4 * sms):
        buf = DeviceArray.empty(((S + 1) * nb,))
        for pdl in (False, True):
            buf.fill_byte(0)
            step = mod.fn("chain_step")
            launches = [driver.Launch(step, (nb,), (256,), [driver.ptr(buf), driver.i32(s), driver.i32(nb)])
                        for s in range(1, S + 1)]  # fmt: skip
            if pdl:
                if not driver.pdl_enabled():
                    continue
                driver.programmatic(launches)
            us = [ms * 1e3 / S for ms in time_launch(launches, stream, args.samples)]
            rows.append((f"a launch a stage{', programmatic' if pdl else ''}", nb, us))
            check(buf, S, nb)
        buf.free()
    buf = DeviceArray.empty(((S + 1) * sms,))
    buf.fill_byte(0)
    bar = DeviceArray.empty((3,), "u4")  # count, gen, failed
    bar.fill_byte(0)
    launch = driver.Launch(mod.fn("chain_persistent"), (sms,), (256,),
                           [driver.ptr(buf), driver.i32(S), driver.ptr(bar)])  # fmt: skip
    us = [ms * 1e3 / S for ms in time_launch(launch, stream, args.samples)]
    rows.append(("one launch, a grid barrier a stage", sms, us))
    if bar.to_host()[2]:
        raise SystemExit("a grid barrier timed out: the persistent grid was not all resident")
    check(buf, S, sms)
    print(f"{info['name']} ({info['arch']}, {sms} SMs), {S} stages, median of {args.samples} samples\n")
    print("| dependency | blocks | us a stage | min-max |")
    print("|---|---|---|---|")
    for name, nb, us in rows:
        print(f"| {name} | {nb} | {statistics.median(us):.3f} | {min(us):.3f}-{max(us):.3f} |")
    return 0


def check(buf: DeviceArray, stages: int, nb: int) -> None:
    got = buf.to_host().reshape(stages + 1, nb)[stages]
    if not np.allclose(got, expected(stages), rtol=1e-5):
        raise SystemExit(f"wrong result: {got[:4]} (expected {expected(stages)})")


if __name__ == "__main__":
    raise SystemExit(main())
