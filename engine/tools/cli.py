"""Command line: `python -m engine {generate,system1,check,prepare} ...`, JSON on stdout.

Exit codes: 0 success; 1 `check` found a mismatch; 2 usage or any error (then stdout holds
`{"error", "error_kind"}`). One-shot commands leave with `os._exit` after flushing, skipping interpreter and driver
teardown, which is not part of the answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

from engine import timing
from engine.errors import EngineError

CHECK_FORMAT = "reflex-check/1"


def _print(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")


def _model_path(model: str) -> str:
    """A GGUF path, or `org/repo[:FILE]` found or fetched as the worker finds MODEL_NAME / MODEL_FILE
    (engine/worker/models.py: a file name or a quant such as Q4_K_M)."""
    from engine.worker import models

    ref = models.parse_reference(model)
    if ref is None:
        return model
    return models.resolve({**os.environ, "MODEL_PATH": "", **ref}).path


def _load(args):
    from engine.engine import Engine

    return Engine.load(_model_path(args.model), backend=args.backend, max_seq_len=args.max_seq_len)


def cmd_system1(args) -> int:
    engine = _load(args)
    _print(engine.system1(args.prompt, args.candidate, temperature=args.temperature))
    return 0


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, stop=args.stop)  # fmt: skip


def cmd_generate(args) -> int:
    engine = _load(args)
    if args.stream:  # one JSON line per chunk, then the result
        stream = engine.generate_stream(args.prompt, **_sampling(args))
        for chunk in stream:
            _print(chunk)
            sys.stdout.flush()
        _print(stream.result)
    else:
        _print(engine.generate(args.prompt, **_sampling(args)))
    return 0


def cmd_prepare(args) -> int:
    from engine.prepare import open_model, write_cache

    summary = write_cache(args.model, args.output)
    with timing.Stopwatch() as sw:
        opened = open_model(args.model)
    summary.update(reopen_ms=round(sw.ms, 3), cache_used=opened.cache_used)
    _print(summary)
    return 0


def _greedy_reference(engine, prompt: str, max_tokens: int) -> dict:
    result = engine.generate(prompt, max_tokens=max_tokens, temperature=0.0)
    first_row = engine.logits(engine.tokenizer.encode(prompt))[-1]
    return {
        "format": CHECK_FORMAT,
        "prompt": prompt,
        "token_ids": result["token_ids"],
        "logit_checksum": math.fsum(float(x) for x in first_row),
        "top1_logit": float(first_row.max()),
        "n_vocab": int(first_row.shape[0]),
    }


def cmd_check(args) -> int:
    """Greedy ids must match exactly; the checksum (f64 sum of the first step's logits) within a relative tolerance."""
    engine = _load(args)
    got = _greedy_reference(engine, args.prompt, args.max_tokens)
    if args.write_reference:
        with open(args.write_reference, "w") as f:
            json.dump(got, f, indent=1)
        _print({"written": args.write_reference, **got})
        return 0
    try:
        with open(args.reference) as f:
            want = json.load(f)
        want_ids, want_sum = list(want["token_ids"]), float(want["logit_checksum"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(_fail_usage(f"cannot read reference {args.reference}: {e}")) from None
    n = min(len(want_ids), len(got["token_ids"]))
    report = {**got, "expected_token_ids": want_ids, "expected_logit_checksum": want_sum}
    delta = abs(got["logit_checksum"] - want_sum) / max(abs(want_sum), 1.0)
    report["relative_delta"] = delta
    if got["token_ids"][:n] != want_ids[:n] or len(want_ids) > len(got["token_ids"]):
        report["status"] = "fail"
        report["reason"] = "token_id_mismatch"
    elif delta > args.tolerance:
        report["status"] = "fail"
        report["reason"] = "logit_checksum_mismatch"
    else:
        report["status"] = "pass"
    _print(report)
    return 0 if report["status"] == "pass" else 1


def cmd_bench(args) -> int:
    from engine.tools.bench import run

    _print(run(args))
    return 0


def cmd_profile(args) -> int:
    from engine.tools.profile import profile

    _print(profile(_load(args), prompt_tokens=args.prompt_tokens, repeats=args.repeats))
    return 0


def cmd_smoke(args) -> int:
    from engine.tools.doctor import smoke

    _print(smoke())
    return 0


def cmd_doctor(args) -> int:
    from engine.tools.doctor import doctor

    report, code = doctor()
    _print(report)
    return code


def _fail_usage(message: str) -> int:
    _print({"error": message, "error_kind": "invalid_input"})
    return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    p.add_argument("--log-level", default=os.environ.get("REFLEX_LOG_LEVEL", "WARNING"))
    sub = p.add_subparsers(dest="command", required=True)

    def model_cmd(name: str, help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("model", help="path of a GGUF file, or org/repo[:FILE or quant] from the Hugging Face cache/Hub")
        s.add_argument("--backend", choices=["auto", "cpu", "cuda"], default=None,
                       help="default: REFLEX_BACKEND, else cuda when a GPU and built kernels are present")  # fmt: skip
        s.add_argument("--max-seq-len", type=int, default=None, help="positions per sequence (default 4096)")
        return s

    s = model_cmd("system1", "score candidate continuations of a prompt")
    s.add_argument("prompt")
    s.add_argument("--candidate", action="append", required=True, help="a candidate text (repeat)")
    s.add_argument("--temperature", type=float, default=1.0, help="softmax temperature over the candidates")
    s.set_defaults(func=cmd_system1)

    g = model_cmd("generate", "generate tokens")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    g.add_argument("--stream", action="store_true", help="print each chunk as a JSON line, then the result")
    g.set_defaults(func=cmd_generate)

    c = model_cmd("check", "greedy ids and a logit checksum against a reference file")
    c.add_argument("prompt")
    c.add_argument("--max-tokens", type=int, default=8)
    c.add_argument("--tolerance", type=float, default=1e-2, help="relative tolerance of the checksum")
    group = c.add_mutually_exclusive_group(required=True)
    group.add_argument("--reference", help=f"a JSON reference ({CHECK_FORMAT}) to compare with")
    group.add_argument("--write-reference", help="write this engine's result as a reference file")
    c.set_defaults(func=cmd_check)

    b = model_cmd("bench", "warm latency/throughput here, cold start over fresh processes (p50/p95)")
    b.add_argument("--repeats", type=int, default=20, help="timed repeats of each warm measurement")
    b.add_argument("--cold", type=int, default=0, help="fresh processes per cold measurement (0: skip)")
    b.set_defaults(func=cmd_bench)

    f = model_cmd("profile", "time each launch of one CUDA decode step, grouped by kernel")
    f.add_argument("--prompt-tokens", type=int, default=64, help="tokens in the cache before the profiled step")
    f.add_argument("--repeats", type=int, default=200, help="graph replays per timed launch")
    f.set_defaults(func=cmd_profile)

    sub.add_parser("smoke", help="run one prebuilt kernel and time the AOT path from process start",
                   description="run one prebuilt kernel (axpy) and time the AOT path from process start"
                   ).set_defaults(func=cmd_smoke)  # fmt: skip
    sub.add_parser("doctor", help="check the GPU, the built kernels and NVML",
                   description="check the GPU, the built kernels (native code for this GPU?) and NVML; exit 1 on a "
                   "failed check").set_defaults(func=cmd_doctor)  # fmt: skip

    about = "write the cold-start cache (tokenizer, metadata, tensor table) next to a model"
    r = sub.add_parser("prepare", help=about, description=about)
    r.add_argument("model")
    r.add_argument("--output", default=None, help="cache path (default: MODEL.reflex-cache)")
    r.set_defaults(func=cmd_prepare)
    return p


def main(argv: list[str] | None = None, fast_exit: bool = True) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.command not in ("prepare", "smoke", "doctor"):
        import engine.engine  # noqa: F401 - the engine's imports belong to imports_ms, not to model_load_ms
    timing.mark_imports_done()
    try:
        code = args.func(args)
    except EngineError as e:
        _print({"error": str(e), "error_kind": e.kind})
        code = 2
    except Exception as e:  # the CLI reports every failure as JSON
        logging.getLogger("engine").exception("internal error")
        _print({"error": f"{type(e).__name__}: {e}", "error_kind": "internal"})
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    if fast_exit:
        os._exit(code)
    return code
