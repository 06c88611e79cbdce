"""Small-batch matmul timings on this GPU for Qwen3-0.6B's matrices (Q4_K, Q6_K): matvec passes of 8, one tc_matvec
launch, the GEMM whole and split over K, per token count, as a markdown table; the kernel-choice rules in
engine/cuda/dispatch.py come from it.

    python scripts/bench_small_batch.py [--n 1,8,9,16,32,64] [--samples 20]

Timing as scripts/bench_gemm.py (REPS launches in one CUDA graph, CUDA events, median and spread over the samples).
The RMSNorm is fused where the model fuses it (q/k/v and gate/up read the residual stream and a norm weight); the
GEMM column adds rmsnorm_rows for those, as the model then launches it. The last lines sum one Q4_K_M-mix layer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gemm import MATRICES, MIX_Q6, N_LAYERS, time_launch, weight

from engine.cuda import dispatch, driver, k_gemm, k_matvec, k_tc_matvec, memory
from engine.cuda import k_norm_rope as knr
from engine.cuda.memory import DeviceArray
from engine.cuda.small_batch import rows
from engine.quants import GGMLType

NORMED = ("attn_q", "attn_k", "attn_v", "ffn_gate+up")  # the matrices whose input is the normed residual stream
WAYS = ("matvec", "tc", "gemm", "gemm_split")


def launches(way: str, wg, wu, swiglu: bool, a: DeviceArray, n: int, c: DeviceArray, norm_w, xb) -> list:
    """One matmul of n tokens the given way (None where that way does not take n)."""
    if way == "matvec":
        if swiglu:
            return [k_matvec.matvec_swiglu(wg, wu, rows(a, at, m), m, rows(c, at, m), norm_w=norm_w, eps=1e-6)
                    for at, m in dispatch.passes(n)]  # fmt: skip
        return [k_matvec.matvec(wg, rows(a, at, m), m, rows(c, at, m), norm_w=norm_w, eps=1e-6)
                for at, m in dispatch.passes(n)]  # fmt: skip
    if way == "tc":
        if n > k_tc_matvec.MAX_TOKENS:
            return None
        if swiglu:
            return [k_tc_matvec.tcmv_swiglu(wg, wu, a, n, c, norm_w=norm_w, eps=1e-6)]
        return [k_tc_matvec.tcmv(wg, a, n, c, norm_w=norm_w, eps=1e-6)]
    pre = [knr.rmsnorm_rows(a, norm_w, 1e-6, xb, n)] if norm_w is not None else []
    src = xb if norm_w is not None else a
    split = way == "gemm_split"
    return [
        *pre,
        k_gemm.gemm_swiglu(wg, wu, src, n, c, split=split) if swiglu else k_gemm.gemm(wg, src, n, c, split=split),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,2,4,8,9,13,16,24,32,48,64,96,128", help="token counts, comma-separated")
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()
    counts = [int(v) for v in args.n.split(",")]
    driver.start_context(0)
    k_gemm.reserve()
    info = driver.device_info(0)
    stream = memory.stream_create()
    rng = np.random.default_rng(0)
    width = max(m[2] for m in MATRICES)
    a = DeviceArray.from_host(rng.normal(size=(max(counts), width)).astype(np.float32))
    xb = DeviceArray.empty((max(counts), width))
    norm_w = DeviceArray.from_host((1 + 0.1 * rng.normal(size=width)).astype(np.float32))
    c = DeviceArray.empty((max(counts), max(m[1] for m in MATRICES)))
    print(f"{info['name']} ({info['arch']}), median of {args.samples} samples of graphs of launches, microseconds\n")
    print("| type | matrix | R x K | n | " + " | ".join(WAYS) + " |")
    print("|---|---|---|---|" + "---|" * len(WAYS))
    layer: dict[tuple[str, int], float] = {}
    for t in (GGMLType.Q4_K, GGMLType.Q6_K):
        for name, r, k, swiglu in MATRICES:
            (ag, wg), (au, wu) = weight(rng, t, r, k), weight(rng, t, r, k)
            nw = norm_w if name in NORMED else None
            for n in counts:
                cells = []
                for way in WAYS:
                    got = launches(way, wg, wu, swiglu, a, n, c, nw, xb)
                    if got is None:
                        cells.append("—")
                        continue
                    us = statistics.median(time_launch(got, stream, args.samples)) * 1e3
                    cells.append(f"{us:.1f}")
                    if (t.name == "Q6_K") == (name in MIX_Q6):
                        layer[way, n] = layer.get((way, n), 0.0) + us
                print(f"| {t.name} | {name} | {r} x {k} | {n} | " + " | ".join(cells) + " |")
            ag.free(), au.free()
    print("\nOne Q4_K_M-mix layer (the matmuls only), microseconds, and the 28-layer prefill rate it implies:\n")
    print("| n | " + " | ".join(WAYS) + " |")
    print("|---|" + "---|" * len(WAYS))
    for n in counts:
        cells = [f"{layer[w, n]:.1f} ({n / (N_LAYERS * layer[w, n]) * 1e6:,.0f} tok/s)" if (w, n) in layer else "—"
                 for w in WAYS]  # fmt: skip
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
