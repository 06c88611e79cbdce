"""A decode step's cost against the context length, for each K/V cache type (KV_CACHE_TYPE), on the CUDA backend.

    python scripts/bench_long_context.py MODEL [--contexts 64,1024,4096,16384,40959] [--kv f32,f16] [--out F.json]

For each cache type the model is loaded once with MAX_SEQ_LEN = the longest context + 1; for each context c a real
prompt of 64 tokens is run, the sequence is moved to position c with rows 64..c-1 of every layer's cache zeroed (the
kernels read the same bytes whatever their values), and the decode step at position c is replayed from one CUDA
graph (engine/tools/profile.py): the whole step, and the attention launches alone. Then DECODE_TOKENS greedy tokens
from there as generate runs them (chained on the device, the host reading each id: `decode_ms` a token, median of
three runs), which is what llama-bench's tg at depth c measures. Memory mapped for the caches is reported beside it
(engine/cuda/vmm.py maps rows as positions are used).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from engine.cuda import memory, vmm
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.tools.profile import replay_ms

ATTENTION = ("attention.attn_decode", "attention.attn_combine", "mla.mla_attn")
DECODE_TOKENS = 32


def zero_rows(caches, first: int, last: int, stream: int) -> None:
    """Rows [first, last) of every layer of every cache set to zero bytes (mapped already)."""
    for cache in caches:
        layers, rows = cache.shape[0], cache.shape[1]
        row_bytes = cache.nbytes // (layers * rows)
        for layer in range(layers):
            start = cache.ptr + (layer * rows + first) * row_bytes
            memory.memset_async(start, 0, (last - first) * row_bytes, stream)
    memory.synchronize(stream)


def at_context(engine: Engine, context: int, repeats: int) -> dict:
    runner, prompt = engine.runner, min(64, context)
    runner.reset()
    ids = [1 + i % (engine.config.n_vocab - 1) for i in range(prompt)]
    runner.forward(ids, out="none")
    vmm.ensure_rows(runner.model.caches, context + 1)
    if context > prompt:
        zero_rows(runner.model.caches, prompt, context, runner.stream)
        runner.position = context
    launches = runner.decode_launches(ids[-1])
    step = replay_ms(launches, runner.stream, repeats)
    attention = [launch for launch in launches if launch.name.startswith(ATTENTION)]
    attn = replay_ms(attention, runner.stream, repeats)
    chained = []
    for _ in range(4):  # the first run captures the chain's graph
        start = time.perf_counter()
        taken = sum(1 for _ in runner.decode_chain(ids[-1], SamplingParams.make(0.0), 0, DECODE_TOKENS))
        chained.append((time.perf_counter() - start) * 1000.0 / taken)
        runner.position = context  # the rows the chain wrote past c are written again by the next run
    decode = statistics.median(chained[1:])
    mapped = sum(c.mapped_bytes for c in runner.model.caches) / 2**20
    read = sum(c.nbytes // c.shape[1] * (context + 1) for c in runner.model.caches)  # every layer's rows 0..c
    return {"context": context, "step_ms": round(step, 4), "tokens_per_s": round(1000.0 / step, 1),
            "attention_ms": round(attn, 4), "attention_launches": len(attention),
            "attention_gb_per_s": round(read / (attn * 1e6), 1), "decode_ms": round(decode, 4),
            "decode_tokens_per_s": round(1000.0 / decode, 1), "kv_mapped_mib": round(mapped, 1)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--contexts", default="64,1024,4096,16384,40959")
    ap.add_argument("--kv", default="f32,f16", help="cache types, comma-separated")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", help="also write the report as JSON here")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    report = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "command": " ".join(sys.argv), "runs": []}
    for kv in args.kv.split(","):
        engine = Engine.load(args.model, backend="cuda", max_seq_len=max(contexts) + DECODE_TOKENS + 1,
                             kv_cache_type=kv)  # fmt: skip
        if engine.backend != "cuda":
            raise SystemExit("bench_long_context: needs the CUDA backend")
        usable = [c for c in contexts if c + DECODE_TOKENS < engine.max_seq]
        for c in usable:
            row = {"kv_cache_type": kv, **at_context(engine, c, args.repeats)}
            print(json.dumps(row), flush=True)
            report["runs"].append(row)
        del engine
        gc.collect()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
