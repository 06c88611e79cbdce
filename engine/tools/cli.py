"""Command line: `python -m engine {generate,system1,check,prepare} ...`, JSON on stdout.

Exit codes: 0 success; 1 `check` found a mismatch; 2 usage or any error (then stdout holds
`{"error", "error_kind"}`, argparse's own usage errors included: every argument is validated here, at the boundary,
and every bad one is an `invalid_input` error naming it). One-shot commands leave with `os._exit` after flushing,
skipping interpreter and driver teardown, which is not part of the answer (tearing the GPU's contexts down first
measured 67-76 ms inside the process and nothing outside it on an H200, 2026-12-05).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

from engine import timing
from engine.errors import EngineError, InvalidInput

CHECK_FORMAT = "reflex-check/1"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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

    return Engine.load(_model_path(args.model), backend=args.backend, max_seq_len=args.max_seq_len,
                       lora=_lora_specs(args), prefix_state=getattr(args, "import_state", None))  # fmt: skip


def _lora_specs(args) -> list[tuple[str, float]]:
    from engine import lora

    return [lora.parse_spec(spec) for spec in getattr(args, "lora", None) or []]


def _exported(engine, args, result: dict) -> dict:
    """With --export-state PATH: the prompt's state written to PATH, its summary added to the result."""
    if getattr(args, "export_state", None):
        result["state_exported"] = engine.save_state(args.prompt, args.export_state)
    return result


def _check_sizes(prompt: str, candidates: list[str] | None = None) -> None:
    """The worker's per-request limits (MAX_CANDIDATES, MAX_PROMPT_CHARS from the environment), here too."""
    from engine.worker.limits import Limits

    limits = Limits.from_env()
    if candidates is not None and len(candidates) > limits.max_candidates:
        raise InvalidInput(f"{len(candidates)} candidates; the limit (MAX_CANDIDATES) is {limits.max_candidates}")
    for what, text in [("the prompt", prompt), *((f"candidate {i}", c) for i, c in enumerate(candidates or []))]:
        if len(text) > limits.max_prompt_chars:
            raise InvalidInput(f"{what} has {len(text)} characters; the limit (MAX_PROMPT_CHARS) is "
                               f"{limits.max_prompt_chars}")  # fmt: skip


def cmd_system1(args) -> int:
    _check_sizes(args.prompt, args.candidate)
    engine = _load(args)
    _print(_exported(engine, args, engine.system1(args.prompt, args.candidate, temperature=args.temperature)))
    return 0


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, stop=args.stop)  # fmt: skip


def cmd_generate(args) -> int:
    _check_sizes(args.prompt)
    engine = _load(args)
    if args.stream:  # one JSON line per chunk, then the result
        stream = engine.generate_stream(args.prompt, **_sampling(args))
        for chunk in stream:
            _print(chunk)
            sys.stdout.flush()
        _print(_exported(engine, args, stream.result))
    else:
        _print(_exported(engine, args, engine.generate(args.prompt, **_sampling(args))))
    return 0


def cmd_prepare(args) -> int:
    from engine.prepare import open_model, write_cache

    summary = write_cache(args.model)
    with timing.Stopwatch() as sw:
        opened = open_model(args.model)
    summary.update(reopen_ms=round(sw.ms, 3), cache_used=opened.cache_used)
    if args.prefix is not None:  # the shared system prompt's state, resumed by every job that starts with it
        from engine import state
        from engine.engine import Engine

        engine = Engine.load(args.model, backend=args.backend, lora=_lora_specs(args))
        summary["prefix"] = engine.save_state(args.prefix, state.prefix_path(args.model))
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
    want_ids, want_sum = _read_reference(args.reference) if args.reference else ([], 0.0)  # before the load
    engine = _load(args)
    got = _greedy_reference(engine, args.prompt, args.max_tokens)
    if args.write_reference:
        with open(args.write_reference, "w") as f:
            json.dump(got, f, indent=1)
        _print({"written": args.write_reference, **got})
        return 0
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


def _read_reference(path: str) -> tuple[list[int], float]:
    """(token ids, logit checksum) of a reference file; anything else is an `invalid_input` error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            want = json.load(f)
        ids, checksum = want["token_ids"], want["logit_checksum"]
        if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
            raise ValueError("token_ids must be a non-empty list of token ids")
        if type(checksum) not in (int, float) or not math.isfinite(checksum):
            raise ValueError("logit_checksum must be a finite number")
    except (OSError, ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError and JSONDecodeError included
        raise InvalidInput(f"cannot read reference {path}: {e}") from None
    return ids, float(checksum)


def _peer(text: str) -> str:
    name, sep, path = text.partition("=")
    if name != "llama.cpp" or not sep or not path:
        raise argparse.ArgumentTypeError(f"expected llama.cpp=BUILD_DIR, got {text!r}")
    return text


def cmd_bench(args) -> int:
    from engine.tools.bench import run

    _print(run(args))
    return 0


def cmd_profile(args) -> int:
    from engine.tools.profile import profile

    _print(profile(_load(args), prompt_tokens=args.prompt_tokens, repeats=args.repeats, ablate=args.ablate,
                   batch=args.batch))  # fmt: skip
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
    sys.stdout.flush()
    return 2


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error reported as the CLI's JSON error (the usage itself goes to stderr)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        raise SystemExit(_fail_usage(f"{self.prog}: {message}"))


def _integer(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is not in [{lo}, {'...' if hi is None else hi}]")
        return value

    return parse


def _number(lo: float, hi: float = math.inf, lo_open: bool = False):
    """An argparse type: a finite number in [lo, hi] ((lo, hi] with lo_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < lo or (lo_open and value == lo) or value > hi:
            bounds = f"{'(' if lo_open else '['}{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number in {bounds}")
        return value

    return parse


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)} (default: REFLEX_LOG_LEVEL)")
    return text.upper()


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine", description=__doc__.splitlines()[0])
    p.add_argument("--log-level", type=_log_level, default=os.environ.get("REFLEX_LOG_LEVEL", "WARNING"))
    sub = p.add_subparsers(dest="command", required=True)

    def model_cmd(name: str, help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("model", help="path of a GGUF file, or org/repo[:FILE or quant] from the Hugging Face cache/Hub")
        s.add_argument("--backend", choices=["auto", "cpu", "cuda"], default=None,
                       help="default: REFLEX_BACKEND, else cuda when a GPU and built kernels are present")  # fmt: skip
        s.add_argument("--max-seq-len", type=_integer(1), default=None, help="positions per sequence (default 4096)")
        _lora_arg(s)
        s.add_argument("--import-state", metavar="PATH", default=None,
                       help="a state file (--export-state) to resume prompts that start with it")  # fmt: skip
        return s

    def _lora_arg(s: argparse.ArgumentParser) -> None:
        s.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                       help="a LoRA adapter GGUF and its scale (default 1); repeat for several")  # fmt: skip

    export = dict(metavar="PATH", default=None, help="also write the prompt's state to PATH (for --import-state)")
    s = model_cmd("system1", "score candidate continuations of a prompt")
    s.add_argument("--export-state", **export)
    s.add_argument("prompt")
    s.add_argument("--candidate", action="append", required=True, help="a candidate text (repeat)")
    s.add_argument("--temperature", type=_number(0.0, lo_open=True), default=1.0,
                   help="softmax temperature over the candidates")  # fmt: skip
    s.set_defaults(func=cmd_system1)

    g = model_cmd("generate", "generate tokens")
    g.add_argument("--export-state", **export)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=_integer(1), default=64)
    g.add_argument("--temperature", type=_number(0.0), default=0.0)
    g.add_argument("--top-k", type=_integer(0), default=0)
    g.add_argument("--top-p", type=_number(0.0, 1.0, lo_open=True), default=1.0)
    g.add_argument("--seed", type=_integer(0, (1 << 63) - 1), default=None)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    g.add_argument("--stream", action="store_true", help="print each chunk as a JSON line, then the result")
    g.set_defaults(func=cmd_generate)

    c = model_cmd("check", "greedy ids and a logit checksum against a reference file")
    c.add_argument("prompt")
    c.add_argument("--max-tokens", type=_integer(1), default=8)
    c.add_argument("--tolerance", type=_number(0.0), default=1e-2, help="relative tolerance of the checksum")
    group = c.add_mutually_exclusive_group(required=True)
    group.add_argument("--reference", help=f"a JSON reference ({CHECK_FORMAT}) to compare with")
    group.add_argument("--write-reference", help="write this engine's result as a reference file")
    c.set_defaults(func=cmd_check)

    b = model_cmd("bench", "warm latency/throughput here, cold start over fresh processes (p50/p95)")
    b.add_argument("--repeats", type=_integer(1), default=20, help="timed repeats of each warm measurement")
    b.add_argument("--cold", type=_integer(0), default=0, help="fresh processes per cold measurement (0: skip)")
    b.add_argument("--drop-page-cache", action="store_true",
                   help="start every cold process with the model out of the page cache (read from the disk, as on a "
                   "node that has not read it yet)")  # fmt: skip
    b.add_argument(
        "--peer",
        metavar="llama.cpp=DIR",
        type=_peer,
        default=None,
        help="also run llama.cpp's llama-simple / llama-bench from this build directory, interleaved",
    )
    b.add_argument("--plot", metavar="FILE", default=None, help="draw the report to an .svg or .png file")
    b.set_defaults(func=cmd_bench)

    f = model_cmd("profile", "time each launch of one CUDA decode step, grouped by kernel")
    f.add_argument("--prompt-tokens", type=_integer(1), default=64, help="tokens in the cache before the profiled step")
    f.add_argument("--repeats", type=_integer(1), default=200, help="graph replays per timed launch")
    f.add_argument("--batch", type=_integer(1), default=1,
                   help="time the forward of this many tokens (a prompt chunk) instead of a decode step")  # fmt: skip
    f.add_argument(
        "--ablate",
        action="store_true",
        help="also time the step without each kernel's launches: what each costs inside the step",
    )
    f.set_defaults(func=cmd_profile)

    sub.add_parser("smoke", help="run one prebuilt kernel and time the AOT path from process start",
                   description="run one prebuilt kernel (axpy) and time the AOT path from process start"
                   ).set_defaults(func=cmd_smoke)  # fmt: skip
    sub.add_parser("doctor", help="check the GPU, the built kernels and NVML",
                   description="check the GPU, the built kernels (native code for this GPU?) and NVML; exit 1 on a "
                   "failed check").set_defaults(func=cmd_doctor)  # fmt: skip

    about = "write the cold-start cache (tokenizer, metadata, tensor table) next to a model, as MODEL.reflex-cache"
    r = sub.add_parser("prepare", help=about, description=about + " (the one place the loader looks for it)")
    r.add_argument("model")
    r.add_argument("--prefix", metavar="TEXT", default=None,
                   help="also bake this prompt prefix's state beside the model (MODEL.reflex-prefix)")  # fmt: skip
    r.add_argument("--backend", choices=["auto", "cpu", "cuda"], default=None, help="backend that runs the prefix")
    _lora_arg(r)
    r.set_defaults(func=cmd_prepare)
    return p


def _undecodable(argv: list[str]) -> str | None:
    """The first argument that is not valid UTF-8 (Python keeps such bytes as lone surrogates), as an error."""
    for i, a in enumerate(argv, 1):
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            return f"argument {i} ({ascii(a)[:60]}) is not valid UTF-8"
    return None


def main(argv: list[str] | None = None, fast_exit: bool = True) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        bad = _undecodable(argv)
        if bad is not None:
            raise SystemExit(_fail_usage(bad))
        args = _parser().parse_args(argv)
    except SystemExit as e:  # a usage error or --help: out the same fast way (the context's thread may be uploading)
        if not fast_exit:
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 2)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
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
