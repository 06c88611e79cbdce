"""`python -m engine bench MODEL`: warm latency and throughput in this process, cold start over fresh processes.

Warm: system1 (a ~10-token prompt, 3 candidates), prefill at 16 and 512 tokens, decode over 128 tokens (EOS
ignored; chained as generate runs it, and one step at a time beside it), each after warm-up, as medians and p95
over repeats, with achieved weight bandwidth beside tokens/s.
Cold: N fresh `python -m engine system1|generate` processes; each one's own phase breakdown plus the wall clock
seen from outside (process spawn to exit), the GPU energy and peak memory it took, p50 / p95 per phase, and whether
every run opened the model through its prepare cache (`prepare_cache_used`; a warning on stderr where not: a worker's
image is built with one, and without it the open parses the whole header and the file is hashed beside the result).
The model's pages stay in the page cache between runs (`page_cache: warm`) unless `--drop-page-cache` drops them
before every process (`dropped`: the disk read of a node that has not read the model yet).
`--peer llama.cpp=BUILD_DIR`: the same file through llama.cpp, interleaved with ours (engine/tools/peer.py), and the
ratios; `--plot FILE.svg|png` draws the cold-start phases and the decode / prefill bars (engine/tools/plot.py).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

from engine import prepare, timing
from engine.errors import InvalidInput

SYSTEM1_PROMPT = "Question: is the sky blue on a clear day? Answer:"
CANDIDATES = [" yes", " no", " maybe"]
FILLER = "The quick brown fox jumps over the lazy dog near the river bank. "


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round((len(s) - 1) * p))]


def _summary(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values), 3), "p95": round(_pct(values, 0.95), 3),
            "min": round(min(values), 3), "n": len(values)}  # fmt: skip


def _timed(fn, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def warm(engine, repeats: int = 20) -> dict:
    from engine.sampling import SamplingParams

    runner = engine.runner
    ids = engine.tokenizer.encode(FILLER * 64)
    weights_bytes = engine.bytes_per_token
    res: dict = {"system1_ms": _summary(_timed(lambda: engine.system1(SYSTEM1_PROMPT, CANDIDATES), repeats, 3))}
    res["system1_prompt_tokens"] = len(engine.tokenizer.encode(SYSTEM1_PROMPT))
    for n in (16, 64, 128, 512):  # one tc_matvec tile, its largest, the split-K GEMM, a full GEMM chunk
        if n > engine.max_seq:
            continue

        def prefill(n=n):
            runner.reset()
            runner.forward(ids[:n], "none")

        t = _summary(_timed(prefill, repeats, 3))
        res[f"prefill_{n}"] = {"ms": t, "tokens_per_s": round(n / t["p50"] * 1000.0, 1)}
    n_decode = min(128, engine.max_seq - 16)
    greedy = SamplingParams.make(0.0)

    def decode(chained: bool) -> float:
        """ms per token over n_decode - 1 steps after a 16-token prompt: chained as generate runs them
        (decode_chain), or one step and its id back at a time (sample_next)."""
        runner.reset()
        tok = runner.sample_next(ids[:16], greedy, 0)
        t0 = time.perf_counter()
        if chained:
            for _ in runner.decode_chain(tok, greedy, 1, n_decode - 1):
                pass
        else:
            for step in range(1, n_decode):
                tok = runner.sample_next([tok], greedy, step)
        return (time.perf_counter() - t0) * 1000.0 / (n_decode - 1)

    decode(True), decode(False)
    runs = [(decode(True), decode(False)) for _ in range(max(3, repeats // 4))]  # interleaved
    for key, per_token in (("decode", [a for a, _ in runs]), ("decode_single_steps", [b for _, b in runs])):
        ms = statistics.median(per_token)
        res[key] = {"tokens": n_decode, "ms_per_token": _summary(per_token), "tokens_per_s": round(1000.0 / ms, 1),
                    "weight_gb_per_s": round(weights_bytes / (ms / 1000.0) / 1e9, 1)}  # fmt: skip
    return res


def system1_argv(model: str, prompt: str, candidates: list[str], backend: str | None) -> list[str]:
    """A fresh `python -m engine system1` process on model, prompt and candidates."""
    argv = [
        sys.executable,
        "-m",
        "engine",
        "system1",
        model,
        prompt,
        *[a for c in candidates for a in ("--candidate", c)],
    ]
    return argv + (["--backend", backend] if backend else [])


def run_cli(argv: list[str], env: dict, cwd: str | None = None) -> tuple[dict, float]:
    """Run one engine CLI process: its JSON result (the last stdout line) and the outside wall clock in ms; a failed
    run raises with what it printed."""
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    wall = (time.perf_counter() - t0) * 1000.0
    return cli_result(p.stdout, p.stderr, " ".join(argv[2:4])), wall


def cli_result(stdout: str, stderr: str, what: str) -> dict:
    """An engine CLI process's JSON result (its last stdout line); a failed run raises with what it printed."""
    lines = stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else {"error": stderr[-500:]}
    if "error" in result:
        raise RuntimeError(f"{what} run failed: {result}")
    return result


def drop_page_cache(model: str) -> None:
    """The model file's pages and its prepare cache's out of the page cache (POSIX_FADV_DONTNEED: clean pages no
    process maps), so that the next process reads them from the disk, as a worker on a node that has not read the
    image's model yet does."""
    for path in (model, prepare.cache_path(model)):
        if os.path.exists(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cold(model: str, runs: int, backend: str | None, peer=None, meter=None,
         drop_cache: bool = False) -> tuple[dict, dict | None]:  # fmt: skip
    """Fresh processes: system1 and generate (1 token), phases p50/p95, the external wall clock, GPU energy and peak
    memory; with a `peer` (engine.tools.peer.LlamaCpp), its cold first token on the same file, interleaved. With
    drop_cache, every process (the peer's too) starts with the model out of the page cache (drop_page_cache)."""
    from engine.tools.peer import Meter

    meter = meter or Meter()
    extra = ["--backend", backend] if backend else []
    jobs = {
        "system1": system1_argv(model, SYSTEM1_PROMPT, CANDIDATES, backend),
        "generate": [sys.executable, "-m", "engine", "generate", model, SYSTEM1_PROMPT, "--max-tokens", "1", *extra],
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    compiled = compile_bytecode()
    ours: dict[str, dict[str, list[float]]] = {name: {} for name in jobs}
    theirs: dict[str, list[float]] = {}
    prepared = early = True

    def fresh(argv: list[str], **kw):
        if drop_cache:
            drop_page_cache(model)
        return meter.run(argv, **kw)

    for _ in range(runs):
        for name, args in jobs.items():
            r = fresh(args, env=env)
            result = cli_result(r.stdout, r.stderr, f"cold {name}")
            phases = {k: v for k, v in result["cold_start"].items() if isinstance(v, float)}
            prepared = prepared and bool(result["cold_start"].get("prepare_cache_used"))
            early = early and bool(result["cold_start"].get("early_upload"))
            _collect(ours[name], phases, r)
        if peer is not None:
            r = fresh(peer.cold_argv(model, SYSTEM1_PROMPT))
            if r.returncode != 0:
                raise RuntimeError(f"{peer.name} cold run failed: {r.stderr[-500:]}")
            _collect(theirs, peer.phases(r.stderr), r)
    summary = {name: {k: _summary(v) for k, v in phases.items()} for name, phases in ours.items()}
    for record in summary.values():
        record["prepare_cache_used"] = prepared
        record["early_upload"] = early  # every process's weights went up on the context's thread (engine/cuda)
        record["bytecode_compiled"] = compiled
        record["page_cache"] = "dropped" if drop_cache else "warm"
    if not prepared:
        print(f"bench: the cold runs opened {model} without its prepare cache (`python -m engine prepare MODEL`, as "
              "the worker image's build does): not a worker's cold start", file=sys.stderr)  # fmt: skip
    return summary, ({k: _summary(v) for k, v in theirs.items()} if peer is not None else None)


def compile_bytecode() -> bool:
    """Write the engine package's bytecode as the worker image's build does (Dockerfile: compileall), so a cold run
    imports it instead of compiling every module's source, which it would on each run where bytecode is not written
    on import (PYTHONDONTWRITEBYTECODE) or into a fresh tree; whether every module compiled (False: a read-only tree,
    and the cold runs pay for compiling, as the report says)."""
    import compileall

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ok = bool(compileall.compile_dir(package, quiet=2))
    if not ok:
        print(f"bench: could not write the bytecode of {package}: the cold runs compile its sources, which the "
              "worker image does not", file=sys.stderr)  # fmt: skip
    return ok


def _collect(into: dict[str, list[float]], phases: dict[str, float], r) -> None:
    for k, v in phases.items():
        into.setdefault(k, []).append(v)
    into.setdefault("external_wall_ms", []).append(r.wall_ms)
    for key in ("energy_j", "peak_vram_mib"):
        if getattr(r, key) is not None:
            into.setdefault(key, []).append(getattr(r, key))


def run(args) -> dict:
    from engine.engine import Engine
    from engine.tools import peer as peers

    if args.drop_page_cache and not args.cold:
        raise InvalidInput("--drop-page-cache applies to the cold runs: give --cold N as well")
    if args.drop_page_cache and not hasattr(os, "posix_fadvise"):
        raise InvalidInput("--drop-page-cache needs posix_fadvise, which this system does not have")
    peer = peers.LlamaCpp(args.peer.split("=", 1)[1]) if args.peer else None  # checked before anything is timed
    report = {"date": time.strftime("%Y-%m-%d"), "model": os.path.basename(args.model), "command": " ".join(sys.argv)}
    meter = peers.Meter()
    report["idle_watts"] = meter.idle_watts() if args.cold else None
    vram_before = _free_mib() if args.backend != "cpu" else None
    engine = Engine.load(args.model, backend=args.backend, max_seq_len=args.max_seq_len)
    report["backend"] = engine.backend
    report["file_mib"] = round(os.path.getsize(args.model) / 2**20, 1)
    if engine.backend == "cuda":
        from engine.cuda import driver

        report["device"] = driver.device_info(0)
        report["vram_resident_mib"] = vram_before - report["device"]["free_mib"]
    report["warm"] = warm(engine, args.repeats)
    del engine  # the GPU is the cold processes' and the peer's from here on
    gc.collect()
    if args.cold:
        report["cold"], peer_cold = cold(args.model, args.cold, args.backend, peer, meter, args.drop_page_cache)
    if peer is not None:
        report["peer"] = {"name": peer.name, "bin": peer.bin, "cold": peer_cold or {}, "warm": peer.bench(args.model)}
        report["ours_vs_peer"] = peers.compare(report)
    report = timing.rounded(report)
    if args.plot:
        from engine.tools.plot import draw

        draw(report, args.plot)
    return report


def _free_mib() -> int | None:
    try:
        from engine.cuda import driver

        driver.start_context(0)
        return driver.device_info(0)["free_mib"]
    except Exception:
        return None
