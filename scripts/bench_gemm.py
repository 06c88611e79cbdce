"""Prefill GEMM timings (kernels/gemm.cu) on this GPU for Qwen3-0.6B's matrices, Q4_K and Q6_K, as a markdown table.

    python scripts/bench_gemm.py [--n 512] [--samples 20]

Each matrix is launched REPS times from one CUDA graph (no Python launch overhead inside the timing); a sample is one
graph launch timed by CUDA events, divided by REPS. Warm-up graph launches are excluded; the table gives the median
and the spread (min-max) over the samples, TFLOP/s (2 n R K per matrix) and the weight bytes per second. The last
lines project a GEMM-only prefill rate for 28 layers with the Q4_K_M mix (attn_v and ffn_down taken as Q6_K).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cuda import driver, k_gemm, memory
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.quants import GGMLType, row_bytes
from tests.quant_data import random_weights

DIM, Q_DIM, KV_DIM, HIDDEN, N_LAYERS = 1024, 2048, 1024, 3072, 28
# name, R, K, swiglu (gate and up in one launch)
MATRICES = [
    ("attn_q", Q_DIM, DIM, False),
    ("attn_k", KV_DIM, DIM, False),
    ("attn_v", KV_DIM, DIM, False),
    ("attn_output", DIM, Q_DIM, False),
    ("ffn_gate+up", HIDDEN, DIM, True),
    ("ffn_down", DIM, HIDDEN, False),
]
MIX_Q6 = ("attn_v", "ffn_down")  # the Q4_K_M recipe keeps these in Q6_K (in part of the layers; all, here)
REPS = 10


def weight(rng: np.random.Generator, t: GGMLType, rows: int, cols: int) -> tuple[DeviceArray, DeviceWeight]:
    array = DeviceArray.from_host(random_weights(rng, t, (rows, cols)))
    return array, DeviceWeight(array.ptr, t, rows, cols, row_bytes(t, cols), t.name)


def time_launch(launch: driver.Launch | list[driver.Launch], stream: int, samples: int) -> list[float]:
    """Per-launch milliseconds (of the whole list, for a list), one value per sample."""
    launches = launch if isinstance(launch, list) else [launch]
    with memory.Graph(stream) as graph:
        for _ in range(REPS):
            for one in launches:
                one(stream)
    timer = memory.Timer(stream)
    for _ in range(3):
        graph.launch()
    memory.synchronize(stream)
    out = []
    for _ in range(samples):
        timer.start()
        graph.launch()
        out.append(timer.stop() / REPS)
    graph.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=512, help="tokens per launch")
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()
    driver.start_context(0)
    info = driver.device_info(0)
    stream = memory.stream_create()
    rng = np.random.default_rng(0)
    n = args.n
    a = DeviceArray.from_host(rng.normal(size=(n, max(m[2] for m in MATRICES))).astype(np.float32))
    c = DeviceArray.empty((n, max(m[1] for m in MATRICES)))
    print(f"{info['name']} ({info['arch']}), n = {n} tokens, median of {args.samples} samples of {REPS} launches\n")
    print("| type | matrix | R x K | median us | min-max us | TFLOP/s | weight GB/s |")
    print("|---|---|---|---|---|---|---|")
    median_ms: dict[tuple[str, str], float] = {}
    for t in (GGMLType.Q4_K, GGMLType.Q6_K):
        for name, rows, cols, swiglu in MATRICES:
            wg, dg = weight(rng, t, rows, cols)
            wu, du = weight(rng, t, rows, cols)
            launch = k_gemm.gemm_swiglu(dg, du, a, n, c) if swiglu else k_gemm.gemm(dg, a, n, c)
            ms = time_launch(launch, stream, args.samples)
            med = statistics.median(ms)
            median_ms[t.name, name] = med
            flop = 2.0 * n * rows * cols * (2 if swiglu else 1)
            wbytes = rows * row_bytes(t, cols) * (2 if swiglu else 1)
            print(f"| {t.name} | {name} | {rows} x {cols} | {med * 1e3:.1f} | {min(ms) * 1e3:.1f}-{max(ms) * 1e3:.1f} "
                  f"| {flop / med / 1e9:.1f} | {wbytes / med / 1e6:.0f} |")  # fmt: skip
            for x in (wg, wu):
                x.free()
    layer_ms = sum(median_ms["Q6_K" if name in MIX_Q6 else "Q4_K", name] for name, *_ in MATRICES)
    layer_flop = sum(2.0 * n * r * k * (2 if s else 1) for _, r, k, s in MATRICES)
    total_ms = N_LAYERS * layer_ms
    print(f"\nQ4_K_M mix, one layer: {layer_ms * 1e3:.1f} us, {layer_flop / layer_ms / 1e9:.1f} TFLOP/s; "
          f"{N_LAYERS} layers: {total_ms:.2f} ms -> GEMM-only prefill {n / total_ms * 1e3:,.0f} tokens/s")  # fmt: skip


if __name__ == "__main__":
    main()
