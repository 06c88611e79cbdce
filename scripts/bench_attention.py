"""Time the attention-side kernels on the GPU (device events; warm-up excluded; median and spread of 20 runs).

    python scripts/bench_attention.py [--layers 28]

Shapes are Qwen3-0.6B's (16 q heads, 8 kv heads, head_dim 128): attn_prefill (and attn_prefill_tc on sm_80+) of 512
tokens at the start and after 1,536 cached ones, attn_decode + combine at 4096 keys (and shorter), qk_rope_kv and
rmsnorm_rows of 512 tokens, and the sampler over a 151936-token vocabulary.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from engine.cuda import driver, memory
from engine.cuda import k_attention as ka
from engine.cuda import k_norm_rope as knr
from engine.cuda import k_sample as ks
from engine.cuda.memory import DeviceArray

H, KVH, HD = 16, 8, 128


def timed(launches: list[driver.Launch], stream: int, reps: int = 20, inner: int = 10) -> tuple[float, float, float]:
    """(median, min, max) milliseconds of one pass over `launches`, replayed from a CUDA graph of `inner` passes so
    that Python's launch overhead is not in the figure."""
    with memory.Graph(stream) as graph:
        for _ in range(inner):
            for launch in launches:
                launch(stream)
    timer = memory.Timer(stream)
    for _ in range(3):
        graph.launch()
    times = []
    for _ in range(reps):
        timer.start()
        graph.launch()
        times.append(timer.stop() / inner)
    graph.destroy()
    return statistics.median(times), min(times), max(times)


def rand(shape: tuple[int, ...], rng: np.random.Generator) -> DeviceArray:
    return DeviceArray.from_host(rng.standard_normal(shape).astype(np.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28, help="layers per forward pass, for the per-pass figures")
    args = ap.parse_args()
    driver.start_context(0)
    info = driver.device_info(0)
    print(f"device: {info['name']} ({info['arch']})")
    stream = memory.stream_create()
    rng = np.random.default_rng(0)
    max_seq, scale = 4096, 1.0 / np.sqrt(HD)
    kc, vc = rand((max_seq, KVH, HD), rng), rand((max_seq, KVH, HD), rng)
    pos = DeviceArray.from_host(np.array([0], np.int32))

    def row(name: str, ms: tuple[float, float, float], extra: str = "") -> None:
        med, lo, hi = ms
        print(f"{name:44s} {med * 1000:9.1f} us  [{lo * 1000:.1f} .. {hi * 1000:.1f}]  {extra}")

    n = 512
    q, out = rand((n, H * HD), rng), DeviceArray.empty((n, H * HD))
    forms = [("attn_prefill", False, 1)]
    if driver.compute_major() >= 8:  # the tensor-core form with one and two key groups (REFLEX_ATTN_TC_KEYS)
        forms += [("attn_prefill_tc", True, 1), ("attn_prefill_tc_k2", True, 2)]
    for p0 in (0, 1536):  # a prompt's first chunk, and one after 1,536 cached tokens
        pos.copy_from_host(np.array([p0], np.int32))
        flops = 4.0 * H * HD * n * (p0 + (n + 1) / 2)  # causal QK^T and PV
        for name, tc, groups in forms:
            ms = timed([ka.attn_prefill(q, kc, vc, pos, n, H, KVH, HD, HD, scale, out, tc=tc, key_groups=groups)],
                       stream)  # fmt: skip
            row(f"{name} n={n} after {p0}", ms, f"{flops / ms[0] / 1e9:.1f} TFLOP/s; x{args.layers} layers: "
                f"{ms[0] * args.layers:.2f} ms")  # fmt: skip
    pos.copy_from_host(np.array([0], np.int32))
    k, v = rand((n, KVH * HD), rng), rand((n, KVH * HD), rng)
    qn, kn = rand((HD,), rng), rand((HD,), rng)
    rope = knr.qk_rope_kv(q, k, v, n, H, KVH, HD, HD, qn, kn, 1e-6, HD, 1e6, 1.0, None, True, pos, kc, vc)
    row(f"qk_rope_kv n={n}", timed([rope], stream))
    x, w = rand((n, 1024), rng), rand((1024,), rng)
    row(f"rmsnorm_rows n={n} K=1024", timed([knr.rmsnorm_rows(x, w, 1e-6, x, n)], stream))

    q1, att = rand((H * HD,), rng), DeviceArray.empty((H * HD,))
    for L in (128, 1024, 4096):
        pos.copy_from_host(np.array([L - 1], np.int32))
        for splits in (32, 64):
            po, pml = DeviceArray.empty((H, splits, HD)), DeviceArray.empty((H, splits, 2))
            tickets = ka.split_counters(KVH)
            for fold in (True, False):
                launches = ([ka.attn_decode(q1, kc, vc, pos, H, KVH, HD, HD, scale, splits, po, pml, tickets, att,
                                            min_chunk=128)] if fold else
                            [ka.attn_decode(q1, kc, vc, pos, H, KVH, HD, HD, scale, splits, po, pml),
                             ka.attn_combine(po, pml, H, splits, HD, att)])  # fmt: skip
                ms = timed(launches, stream)
                gbs = L * KVH * 2 * HD * 4 / ms[0] / 1e6
                what = "folded" if fold else "+ combine"
                row(f"attn_decode {what} L={L} splits={splits}", ms, f"{gbs:.0f} GB/s of K/V")

    V = 151936  # LM-like logits: a broad tail and a few dozen likely tokens
    host = (rng.standard_normal(V) * 2.0).astype(np.float32)
    host[rng.choice(V, size=40, replace=False)] += rng.uniform(6.0, 14.0, 40).astype(np.float32)
    logits = DeviceArray.from_host(host)
    tok, step = DeviceArray.empty((1,), "i4"), DeviceArray.from_host(np.array([0], np.int32))
    row(f"argmax V={V}", timed([ks.argmax(logits, V, tok)], stream))
    for t, top_k, top_p in ((0.7, 20, 0.95), (0.8, 0, 0.9), (1.0, 0, 1.0), (0.6, 0, 0.95)):
        row(f"sample V={V} T={t} top_k={top_k} top_p={top_p}",
            timed([ks.sample(logits, V, t, top_k, top_p, 1234, step, tok)], stream))  # fmt: skip


if __name__ == "__main__":
    main()
