"""The serverless worker's job runner: one loaded engine; docs/design.md §4 job inputs in, results or typed errors out.

`Worker.run(job_input)` is a generator of outputs, which is the shape a streaming Runpod handler needs; each `next()`
does at most one engine step, and a step that produces nothing to send yields None (engine/worker/aio.py drives it
off the event loop, so a cancel lands between two steps):
- system1, non-streamed generate and non-streamed OpenAI jobs yield exactly one result;
- a streamed generate (`"stream": true`) yields `{"text", "token_ids"}` batches of 1, 3, 9, 27, then 48 tokens
  (per-yield HTTP cost stays small while the first token still leaves at once), then the full result;
- a streamed OpenAI job yields server-sent-event text (`data: {...}\\n\\n`), closing with `data: [DONE]`;
- any failure yields `{"error", "error_kind"}` as the last output (plus `"refresh_worker": True` after a CUDA fault
  that may have left the context unusable). Nothing raises out of `run` but GeneratorExit.
The worker's first result carries the engine's cold-start record (timing.ColdStart), into which the worker's own
phases (`boot`: SDK import, worker ready, first job) are written.
The job schemas (pydantic) are imported and built on first use, or earlier off the cold path (handler.py: the system1
job's before the first job, the others after it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from engine import timing
from engine.engine import Engine
from engine.errors import CudaError, EngineError
from engine.worker.limits import Limits
from engine.worker.vllm import Settings, batch_output, is_vllm_job

if TYPE_CHECKING:
    from engine.worker import jobs

log = logging.getLogger(__name__)

STREAM_FIRST, STREAM_GROWTH, STREAM_LARGEST = 1, 3, 48  # tokens per streamed batch: 1, 3, 9, 27, 48, 48, ...


def error_output(e: BaseException) -> dict:
    """docs/design.md §4's error object for an exception."""
    if isinstance(e, EngineError):
        out = {"error": str(e), "error_kind": e.kind}
    elif isinstance(e, MemoryError):
        out = {"error": "out of host memory", "error_kind": "out_of_memory"}
    else:
        out = {"error": f"{type(e).__name__}: {e}", "error_kind": "internal"}
    if isinstance(e, CudaError):
        out["refresh_worker"] = True
    return out


def batches(chunks: Iterable[dict], first: int = STREAM_FIRST, growth: int = STREAM_GROWTH,
            largest: int = STREAM_LARGEST) -> Iterator[dict | None]:  # fmt: skip
    """Merge the engine's per-token `{"text", "token_ids"}` chunks into batches of growing size; a token that does
    not complete a batch yields None (a step done: see engine/worker/aio.py)."""
    it = iter(chunks)
    try:
        size, text, ids = first, [], []
        for chunk in it:
            text.append(chunk["text"])
            ids.extend(chunk["token_ids"])
            if len(ids) >= size:
                yield {"text": "".join(text), "token_ids": ids}
                size, text, ids = min(size * growth, largest), [], []
            else:
                yield None
        if ids or any(text):
            yield {"text": "".join(text), "token_ids": ids}
    finally:  # an abandoned stream must give the engine's lock back now, not when garbage-collected
        close = getattr(it, "close", None)
        if close is not None:
            close()


class Worker:
    def __init__(self, engine: Engine | None, limits: Limits, load_error: EngineError | None = None,
                 served_name: str | None = None):  # fmt: skip
        self.engine = engine
        self.limits = limits
        self.load_error = load_error
        # the real file's name: the image links /models/model.gguf to the file it downloaded
        path = os.path.realpath(engine.path) if engine is not None else "model"
        self.served_name = served_name or os.path.basename(path).removesuffix(".gguf")
        # The worker's own cold-start phases (set by the entry point) go into the engine's one record.
        self.boot: dict[str, Any] = engine.cold_start if engine is not None else {}
        self._first_job_seen = False
        self.settings = Settings()
        self.reasoning = False  # split <think> into reasoning_content (engine/worker/reasoning.py)

    @classmethod
    def load(cls, model_path: str | None = None, env: Mapping[str, str] = os.environ) -> Worker:
        """Engine from `model_path`, else the model the environment names (engine/worker/models.py: MODEL_PATH,
        MODEL_NAME + MODEL_FILE, the image's baked model), else the bundled default; settings from the
        environment, worker-vllm's names included (engine/worker/vllm.py).

        A failure to load is kept, not raised: every job then answers with it (typed), and the fitness check
        (`check_ready`) fails so the platform replaces the worker.
        """
        from engine.worker import models, reasoning, vllm

        served = None
        try:
            settings = vllm.Settings.from_env(env)
            served = settings.served_name
            resolved = models.Resolved(model_path, "path") if model_path else models.resolve(env)
            if resolved is not None and resolved.source != "path":
                models.ensure_prepared(resolved.path)
            from engine import lora

            adapters = lora.parse_env(env.get(lora.ENV))  # LORA_ADAPTERS="PATH[:SCALE],...", applied at load
            engine = Engine.load(resolved.path if resolved else None, max_seq_len=settings.max_seq_len, lora=adapters,
                                 kv_cache_type=settings.kv_cache_type)  # fmt: skip
            if settings.chat_template:
                engine.tokenizer.chat_template = settings.chat_template
            worker = cls(engine, Limits.from_env(env), served_name=served)
            worker.settings = settings
            worker.reasoning = reasoning.enabled(engine.tokenizer.chat_template, env.get("REASONING_PARSER"))
            worker.boot["model_source"] = resolved.source if resolved else "default"
            return worker
        except Exception as e:
            from engine import cuda

            started = cuda.take_prestarted()  # a failure before Engine.load took the prestarted context
            if started is not None:
                started.abandon()  # its early weight upload is freed: this worker keeps serving errors
            log.exception("the engine failed to load")
            err = e if isinstance(e, EngineError) else EngineError(error_output(e)["error"])
            return cls(None, Limits(), err, served)

    def check_ready(self) -> None:
        """Raises when the engine did not load (a Runpod fitness check)."""
        if self.engine is None:
            raise RuntimeError(f"the engine did not load: {self.load_error}")

    # -- jobs -------------------------------------------------------------------------------------------------

    def run(self, job_input: Any) -> Iterator[dict | str | None]:
        if not self._first_job_seen:
            self._first_job_seen = True
            self.boot["process_start_to_first_job_ms"] = timing.since_process_start_ms()
        if self.engine is None:
            yield self._error(self.load_error, job_input)
            return
        try:
            from engine.worker import jobs

            if is_vllm_job(job_input):
                yield from self._vllm(job_input)
                return
            job = jobs.parse(job_input, self.limits)
            if isinstance(job, jobs.System1Job):
                result = self.engine.system1(self._prompt(job), job.candidates, temperature=job.temperature)
                yield result
            elif isinstance(job, jobs.GenerateJob):
                yield from self._generate(self._prompt(job), job.sampling(self.limits), job.stream)
            elif isinstance(job, jobs.ModelsRequest):
                from engine.worker import openai_api

                created = int(os.path.getmtime(self.engine.path))
                yield openai_api.models(self.served_name, created, self.engine.max_seq)
            else:
                from engine.worker import openai_jobs

                yield from openai_jobs.answer(self, job)
        except Exception as e:  # the worker keeps serving after every failure; GeneratorExit is not caught
            if not isinstance(e, EngineError):
                log.exception("internal error")
            yield self._error(e, job_input)

    @staticmethod
    def _error(e: BaseException, job_input: Any) -> dict:
        """The error output; an OpenAI route's carries OpenAI's error object (its kind rides along)."""
        out = error_output(e)
        if isinstance(job_input, dict) and "openai_route" in job_input:
            from engine.worker import openai_api

            out["error"] = openai_api.error(out)[0]["error"]
        return out

    def _prompt(self, job: jobs.System1Job | jobs.GenerateJob) -> str:
        if job.prompt is not None:
            return job.prompt
        return self.engine.apply_chat_template([m.for_template() for m in job.messages],
                                               **(job.chat_template_kwargs or {}))  # fmt: skip

    def _generate(self, prompt: str, sampling: dict, stream: bool) -> Iterator[dict | None]:
        s = self.engine.generate_stream(prompt, **sampling)  # limits and context overflow raise here, before any yield
        if stream:
            yield from self.stream_batches(s)
        else:
            for _ in s:  # one decode step per tick
                yield None
        yield s.result

    def stream_batches(self, stream) -> Iterator[dict | None]:
        st = self.settings
        return batches(stream, st.stream_first, st.stream_growth, st.stream_largest)

    def _vllm(self, job_input: dict) -> Iterator[dict | None]:
        """worker-vllm's native job, answered in its shape (engine/worker/vllm.py)."""
        from engine.worker import vllm_jobs

        job = vllm_jobs.parse(job_input, self.limits)
        chat = job.chat()
        prompt = self.engine.apply_chat_template(chat) if chat is not None else job.prompt
        s = self.engine.generate_stream(prompt, **job.sampling_params.engine_args(self.limits))
        st = self.settings
        size, growth, largest = job.batch_sizes(st.stream_first, st.stream_growth, st.stream_largest)
        texts, n_prompt, n_out = [], 0, 0
        for chunk in s:
            n_out += len(chunk["token_ids"])
            n_prompt = n_prompt or len(s.stream.prompt_ids)
            if not job.stream:
                yield None
                continue
            texts.append(chunk["text"])
            if len(texts) >= size:
                yield batch_output(texts, n_prompt, n_out)
                texts, size = [], min(int(size * growth), largest)
            else:
                yield None
        if not job.stream:
            yield batch_output([s.result["text"]], s.result["usage"]["prompt_tokens"], n_out)
        elif texts:
            yield batch_output(texts, n_prompt, n_out)

    def room(self, prompt: str) -> int:
        """OpenAI's default max_tokens: whatever the context has left, up to MAX_NEW_TOKENS."""
        room = self.engine.max_seq - len(self.engine.tokenizer.encode(prompt))
        return max(1, min(self.limits.max_new_tokens, room))
