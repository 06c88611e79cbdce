"""The public API: `Engine.load(path)`, then `.system1(...)`, `.generate(...)`, `.generate_stream(...)`, `.logits(...)`.

Requests are served one at a time (a lock), each from a fresh sequence. The first result after a load carries the
cold-start breakdown; later ones carry `cold_start: None`.
LoRA adapters (engine/lora.py) are checked against the file before a backend is built; a prefix state
(engine/state.py: given, or baked beside the model by `prepare --prefix`) is resumed by every request whose prompt
ids start with its ids, and such results report `timings.prefix_tokens_reused`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence

from engine import cache_type, errors, models, state, system1, timing
from engine import lora as _lora
from engine.config import ModelConfig
from engine.errors import ContextOverflow, CudaError, GGUFError, InvalidInput, UnsupportedArchitecture, env_int
from engine.generation import GenerateStream
from engine.gguf import TensorInfo
from engine.prepare import file_sha256, open_model
from engine.sampling import SamplingParams
from engine.text.tokenizer import Tokenizer
from engine.timing import Stopwatch
from engine.weights import quant_mix

log = logging.getLogger(__name__)

DEFAULT_MAX_SEQ = 4096


def _start_backend(requested: str | None):
    """("cpu" | "cuda" | "auto", a ContextStarter or None). For CUDA the context is created on a thread from here
    on, overlapping the model open and the tokenizer build; "auto" means CUDA when kernels are built and a driver
    is present, with a fall-back to the CPU if the context then cannot be created."""
    from engine import cuda

    choice = cuda.backend_choice(requested)
    started = cuda.take_prestarted()
    if choice == "cpu":
        if started is not None:  # started before the choice was known: its thread ends, its upload is freed
            started.abandon()
        return "cpu", None
    from engine.cuda import context, driver

    if started is not None:
        return choice, started
    if choice == "auto" and not cuda.kernels_built():
        return "cpu", None
    try:
        driver.libcuda()
    except CudaError:
        if choice == "auto":
            return "cpu", None
        raise
    return choice, context.ContextStarter(env_int("REFLEX_DEVICE", 0))


def _cuda_runner(config: ModelConfig, gf, max_seq: int, context, adapters: list[_lora.Adapter], kv_dtype: str):
    from engine.cuda import load_runner

    if adapters:
        from engine.cuda import lora as cuda_lora

        cuda_lora.check_supported(config, adapters)  # before the upload
    runner, phases = load_runner(config, gf, max_seq, context, kv_dtype)
    if adapters:
        phases["lora_ms"] = cuda_lora.attach(runner.model, adapters, runner.stream)
    return runner, phases


def _cpu_runner(config: ModelConfig, gf, max_seq: int, adapters: list[_lora.Adapter], kv_dtype: str):
    from engine.cpu import lora as cpu_lora
    from engine.cpu.runner import CpuRunner

    model = models.family(config.arch).CpuModel(config, gf)
    cpu_lora.attach(model, adapters)
    return CpuRunner(model, max_seq, kv_dtype)


class _Prefix:
    """A loaded prefix state: the file and whether it was asked for (then a mismatch is an error, not a log line)."""

    def __init__(self, sf: state.StateFile, explicit: bool):
        self.file = sf
        self.token_ids = sf.token_ids
        self.explicit = explicit


def _open_prefix(path: str | None, model_path: str, sha256: str, cfg_hash: str, max_seq: int) -> _Prefix | None:
    """The prefix state `path`, else the one baked beside the model (ignored, with a log line, when it does not
    belong to this model, config and adapters)."""
    explicit = path is not None
    path = os.fspath(path) if explicit else state.prefix_path(model_path)
    if not explicit and not os.path.exists(path):
        return None
    try:
        sf = state.load(path)
        state.check_pairing(sf, sha256, cfg_hash, max_seq)
    except (InvalidInput, GGUFError, ContextOverflow) as e:
        if explicit:
            raise
        log.warning("ignoring the prefix state beside the model: %s", e)
        return None
    return _Prefix(sf, explicit)


def _checked_layout(prefix: _Prefix, runner) -> _Prefix | None:
    """The prefix if its cache layout and arrays are what `runner` holds; a mismatch of a prefix that was asked
    for is an error, of a baked one a log line."""
    try:
        state.check_layout(prefix.file, runner.state_layout, runner.state_spec(prefix.file.n_positions))
    except (InvalidInput, UnsupportedArchitecture) as e:
        if prefix.explicit:
            raise
        log.warning("ignoring the prefix state beside the model: %s", e)
        return None
    return prefix


def decode_bytes(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> int:
    """Weight bytes one decode step reads: every tensor, but of an untied token_embd none (one row) and of each
    routed-expert stack only the chosen experts' share (n_experts_used of n_experts)."""
    total = 0
    for name, t in tensors.items():
        if name == "token_embd.weight" and not config.tied_output:
            continue
        if "_exps." in name and config.moe is not None:
            total += t.n_bytes * config.moe.n_experts_used // config.moe.n_experts
        else:
            total += t.n_bytes
    return total


class Engine:
    def __init__(self, path: str, config: ModelConfig, tokenizer: Tokenizer, runner, model_info: dict,
                 cold_start: dict, sha256: str | None, adapters: list | None = None,
                 prefix: _Prefix | None = None):  # fmt: skip
        self.path = path
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.backend = runner.backend
        self.max_seq = runner.max_seq
        self._model_info = model_info
        self.cold_start = timing.ColdStart(cold_start)  # phases so far; others (the worker's boot) add theirs
        self._sha256 = sha256
        self._sha_thread: threading.Thread | None = None
        if sha256 is None:  # no prepare cache: hash the file beside the first request instead of before it
            self._sha_thread = threading.Thread(target=self._hash_file, daemon=True)
            self._sha_thread.start()
        self._lock = threading.Lock()
        self.adapters = adapters or []
        self.prefix = prefix

    @classmethod
    def load(cls, path: str | None = None, backend: str | None = None, max_seq_len: int | None = None,
             lora: Sequence[tuple[str, float]] | None = None, prefix_state: str | None = None,
             kv_cache_type: str | None = None) -> Engine:  # fmt: skip
        """Open a GGUF (through its prepare cache when valid), build the tokenizer and the chosen backend.

        lora: [(adapter_path, scale), ...] applied beside the base weights; prefix_state: a state file to resume
        requests from (default: MODEL.reflex-prefix when present); kv_cache_type: "f32" or "f16" (default:
        KV_CACHE_TYPE, else f32; engine/cache_type.py)."""
        load_start = timing.now()
        chosen, context = _start_backend(backend)
        try:
            return cls._load(load_start, chosen, context, path, max_seq_len, lora, prefix_state, kv_cache_type)
        except BaseException:
            if context is not None:  # its thread ends; an early weight upload nobody took is freed
                context.abandon()
            raise

    @classmethod
    def _load(cls, load_start: float, chosen: str, context, path, max_seq_len, lora, prefix_state,
              kv_cache_type) -> Engine:  # fmt: skip
        from engine.bundled import default_model_path

        path = os.fspath(path) if path is not None else default_model_path()
        with Stopwatch() as open_sw:
            opened = open_model(path)
        gf = opened.file
        try:
            config = ModelConfig.from_gguf(gf.metadata, gf.tensors)
        except (GGUFError, UnsupportedArchitecture) as e:  # the config knows the keys, not the file
            raise errors.naming_file(e, path) from None
        limit = max_seq_len or env_int("MAX_SEQ_LEN", DEFAULT_MAX_SEQ, minimum=1)
        kv_name = cache_type.resolve(kv_cache_type)
        kv_dtype = cache_type.DTYPES[kv_name]
        max_seq = max(1, min(limit, config.n_ctx))
        adapters = _lora.open_adapters(lora, gf)  # a mismatched adapter fails here, before any allocation
        sha256, prefix = opened.sha256, None
        if prefix_state is not None or os.path.exists(state.prefix_path(path)):
            sha256 = sha256 or file_sha256(path)
            cfg_hash = state.config_hash(config, _lora.identity(adapters))
            prefix = _open_prefix(prefix_state, path, sha256, cfg_hash, max_seq)
        cuda_phases: dict = {"cuda_init_ms": None}
        with Stopwatch() as load_sw:
            tokenizer = opened.tokenizer or Tokenizer.from_gguf(gf)
            runner = None
            if context is not None:
                try:
                    runner, cuda_phases = _cuda_runner(config, gf, max_seq, context, adapters, kv_dtype)
                except (CudaError, UnsupportedArchitecture) as e:
                    if chosen == "cuda":
                        raise
                    context.abandon()
                    log.warning("CUDA backend unavailable (%s): using the CPU backend", e)
            if runner is None:
                runner = _cpu_runner(config, gf, max_seq, adapters, kv_dtype)
            if prefix is not None:
                prefix = _checked_layout(prefix, runner)
        imports_done = timing.IMPORTS_DONE if timing.IMPORTS_DONE is not None else load_start
        cold_start = {
            "imports_ms": (imports_done - timing.PROCESS_START) * 1000.0,
            "gguf_open_ms": open_sw.ms,
            **cuda_phases,
            "model_load_ms": load_sw.ms,
            "prepare_cache_used": opened.cache_used,
            "process_start_to_ready_ms": timing.since_process_start_ms(),
        }
        info = {
            "arch": config.arch,
            "name": gf.metadata.get("general.name"),
            "file": os.path.basename(path),
            "quant_mix": quant_mix(gf),
            "n_vocab": config.n_vocab,
            "max_seq_len": max_seq,
            "kv_cache_type": kv_name,
        }
        if adapters:
            info["lora"] = _lora.identity(adapters)
        log.info("loaded %s (%s) on %s in %.1f ms", path, config.arch, runner.backend, timing.ms_since(load_start))
        engine = cls(path, config, tokenizer, runner, info, cold_start, sha256, adapters, prefix)
        engine.bytes_per_token = decode_bytes(config, gf.tensors)
        return engine

    # -- helpers --------------------------------------------------------------------------------------------

    def _hash_file(self) -> None:
        self._sha256 = file_sha256(self.path)

    @property
    def sha256(self) -> str | None:
        """The model file's sha256 (waits for the hashing thread when there was no prepare cache)."""
        if self._sha_thread is not None:
            self._sha_thread.join()
            self._sha_thread = None
        return self._sha256

    @property
    def model_info(self) -> dict:
        """What a result says of the model; its sha256 (first 16 hex digits) is null while the hashing thread still
        runs: a result never waits for it (an unprepared 17.7 GB file took ~17 s to hash on an H200 host)."""
        thread = self._sha_thread
        sha = self._sha256 if thread is None or not thread.is_alive() else None
        return {**self._model_info, "sha256": sha[:16] if sha else None}

    def _finish(self, result: dict, total_key: str, total_at: float) -> dict:
        """Attach model, backend and (on the first result only) the cold-start breakdown."""
        cold = self.cold_start.take(
            prompt_eval_ms=result["timings"]["prompt_eval_ms"],
            **{total_key: (total_at - timing.PROCESS_START) * 1000.0},
        )
        result["timings"] = timing.rounded(result["timings"])
        result.update(cold_start=cold, model=self.model_info, backend=self.backend)
        return result

    def _encode_prompt(self, prompt: str, add_eos: bool | None = None) -> list[int]:
        if not isinstance(prompt, str):
            raise InvalidInput("prompt must be a string")
        ids = self.tokenizer.encode(prompt, add_eos=add_eos)
        if not ids:
            raise InvalidInput("the prompt encodes to no tokens: there is nothing to condition on")
        return ids

    def _begin(self, prompt_ids: list[int]) -> int:
        """Start a fresh sequence (the lock is held): from the prefix state when the prompt's ids start with its
        ids and go on past them (the state holds no logits), else from position 0. Returns the ids reused."""
        self.runner.reset()
        p = self.prefix
        if p is None or len(prompt_ids) <= len(p.token_ids) or prompt_ids[: len(p.token_ids)] != p.token_ids:
            return 0
        self.runner.import_state(p.file)
        return len(p.token_ids)

    def _state_header(self, ids: list[int]) -> dict:
        return {
            "model_sha256": self.sha256,
            "config_hash": state.config_hash(self.config, _lora.identity(self.adapters)),
            "layout": self.runner.state_layout,
            "backend": self.backend,
            "model_file": os.path.basename(self.path),
            "lora": _lora.identity(self.adapters),
            "n_positions": len(ids),
            "token_ids": ids,
        }

    # -- public API -----------------------------------------------------------------------------------------

    def system1(self, prompt: str, candidates: Sequence[str], temperature: float = 1.0) -> dict:
        """Score each candidate continuation of `prompt` in one prefill (docs/design.md §4)."""
        if isinstance(candidates, str) or not candidates or not all(isinstance(c, str) for c in candidates):
            raise InvalidInput("candidates must be a non-empty list of strings")
        t0 = timing.now()
        with Stopwatch() as tok_sw:
            # Candidates continue the prompt's text: no EOS after it (a file that asks for one would end every
            # encoding with it, and no candidate could be told apart from the prompt by the difference).
            prompt_ids = self._encode_prompt(prompt, add_eos=False)
        if len(prompt_ids) > self.max_seq:
            raise ContextOverflow(len(prompt_ids), self.max_seq, "the prompt")
        cand_ids: list[list[int]] = []
        cand_sw = Stopwatch()

        def first_ids() -> list[int]:
            """The candidates' ids, encoded while the prompt's forward runs on the device; their first tokens."""
            with cand_sw:
                cand_ids.extend(system1.candidate_ids(
                    lambda s: self.tokenizer.encode(s, add_bos=False, add_eos=False), prompt, candidates))  # fmt: skip
            needed = len(prompt_ids) + max(len(c) for c in cand_ids) - 1
            if needed > self.max_seq:
                raise ContextOverflow(needed, self.max_seq, "the prompt plus the longest candidate")
            return [c[0] for c in cand_ids]

        with self._lock:
            with Stopwatch() as prompt_sw:
                reused = self._begin(prompt_ids)
                scores = [float(s) for s in self.runner.forward(prompt_ids[reused:], "last", first_ids)]
            with Stopwatch() as forced_sw:
                # The state after the prompt, for candidates of several tokens only (a hybrid model's snapshot copies
                # its recurrent state on the device).
                after_prompt = self.runner.snapshot() if any(len(ids) > 1 for ids in cand_ids) else None
                for j, ids in enumerate(cand_ids):
                    if len(ids) > 1:  # teacher-forced: feed all but the last token, gather each next token's logit
                        self.runner.restore(after_prompt)
                        scores[j] += math.fsum(float(s) for s in self.runner.forward(ids[:-1], "all", ids[1:]))
            done_at = timing.now()
        probs = system1.probabilities(scores, temperature)
        best = system1.best_index(scores)
        result = {
            "candidates": [
                {"idx": i, "text": text, "token_ids": ids, "score": s, "probability": p}
                for i, (text, ids, s, p) in enumerate(zip(candidates, cand_ids, scores, probs, strict=True))
            ],
            "best_idx": best,
            "best_text": candidates[best],
            "entropy_bits": system1.entropy_bits(probs),
            "timings": {  # the candidates' encoding (in tokenize_ms) ran inside prompt_eval_ms, beside the device
                "tokenize_ms": tok_sw.ms + cand_sw.ms,
                "prompt_eval_ms": prompt_sw.ms,
                "decode_ms": forced_sw.ms,
                "tokens_per_s": None,
                "total_ms": timing.ms_since(t0),
            },
        }
        if self.prefix is not None:
            result["timings"]["prefix_tokens_reused"] = reused
        return self._finish(result, "process_start_to_result_ms", done_at)

    def generate_stream(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                        top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None,
                        chooser=None):  # fmt: skip
        """An iterator of `{"text", "token_ids"}` chunks; the full result is its `.result` once exhausted.
        `chooser(logits, params, step) -> id` (optional) picks each token from the host logits row instead of the
        backend's own sampler: logprobs and constrained decoding (engine/generation.py)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidInput(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        stops = list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise InvalidInput("stop must be a list of strings")
        params = SamplingParams.make(temperature, top_k, top_p, seed)
        with Stopwatch() as tok_sw:
            prompt_ids = self._encode_prompt(prompt)
        if len(prompt_ids) + max_tokens > self.max_seq:
            raise ContextOverflow(len(prompt_ids) + max_tokens, self.max_seq, "the prompt plus max_tokens")
        return _LockedStream(self, GenerateStream(self.runner, self.tokenizer, prompt_ids, params, max_tokens,
                                                  stops, tok_sw.ms, chooser))  # fmt: skip

    def generate(self, prompt: str, **kwargs) -> dict:
        stream = self.generate_stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Prompt text for chat `messages` ([{"role", "content"}]) through the GGUF's template (engine/text/chat.py)."""
        from engine.text import chat

        tok = self.tokenizer
        bos, eos = ("" if i is None else tok.piece(i, skip_special=False).decode("utf-8", "replace")
                    for i in (tok.bos_id, tok.eos_id))  # fmt: skip
        return chat.render(tok.chat_template, messages, bos, eos, add_generation_prompt, **extra)

    def logits(self, token_ids: Sequence[int], prefill: int | None = None):
        """float32 (n_tokens, n_vocab): row j is the output after consuming token_ids[0..j].

        The first `prefill` tokens (default: all) go through as one batch, the rest one at a time through the
        decode path, which is how the fixtures' greedy-step rows were made.
        """
        ids = [int(t) for t in token_ids]
        if not ids or any(not 0 <= t < self.config.n_vocab for t in ids):
            raise InvalidInput(f"token_ids must be a non-empty list of ids in [0, {self.config.n_vocab})")
        if len(ids) > self.max_seq:
            raise ContextOverflow(len(ids), self.max_seq, "token_ids")
        import numpy as np

        n = len(ids) if prefill is None else max(1, min(prefill, len(ids)))
        with self._lock:
            self.runner.reset()
            rows = [self.runner.forward(ids[:n], "all")]
            rows += [self.runner.forward([t], "last")[None, :] for t in ids[n:]]
        return np.concatenate(rows).astype(np.float32, copy=False)

    def save_state(self, prompt: str, path: str) -> dict:
        """Run `prompt` from position 0 and write the caches after it to a state file (engine/state.py), for
        `Engine.load(..., prefix_state=path)`. Returns a summary (path, bytes, n_positions, timings)."""
        ids = self._encode_prompt(prompt)
        if len(ids) > self.max_seq:
            raise ContextOverflow(len(ids), self.max_seq, "the prompt")
        header = self._state_header(ids)  # first: a runner without state files refuses here
        with self._lock:
            self.runner.reset()
            with Stopwatch() as prompt_sw:
                self.runner.forward(ids, "none")
            with Stopwatch() as save_sw:
                summary = state.save(path, header, self.runner.export_state())
        return {**summary, "prompt_eval_ms": round(prompt_sw.ms, 3), "save_ms": round(save_sw.ms, 3)}


class _LockedStream:
    """Holds the engine's lock while the generation runs and finishes the result when it ends."""

    def __init__(self, engine: Engine, stream: GenerateStream):
        self.engine = engine
        self.stream = stream
        self.result: dict | None = None

    def __iter__(self):
        prompt_ids = self.stream.prompt_ids
        with self.engine._lock:
            reused = self.engine._begin(prompt_ids)
            self.stream.prompt_ids = prompt_ids[reused:]  # the stream feeds only what the cache does not hold
            try:
                yield from self.stream
            finally:
                self.stream.prompt_ids = prompt_ids
        result = self.stream.result
        if self.engine.prefix is not None:
            result["usage"]["prompt_tokens"] = len(prompt_ids)
            result["timings"]["prefix_tokens_reused"] = reused
        self.result = self.engine._finish(result, "process_start_to_first_token_ms", self.stream.first_token_at)
