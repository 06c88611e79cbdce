"""The serverless worker's job runner: one loaded engine; docs/design.md §4 job inputs in, results or typed errors out.

`Worker.run(job_input)` is a generator of outputs, which is the shape a streaming Runpod handler needs:
- system1, non-streamed generate and non-streamed OpenAI jobs yield exactly one result;
- a streamed generate (`"stream": true`) yields `{"text", "token_ids"}` batches of 1, 3, 9, 27, then 48 tokens
  (per-yield HTTP cost stays small while the first token still leaves at once), then the full result;
- a streamed OpenAI job yields server-sent-event text (`data: {...}\\n\\n`), closing with `data: [DONE]`;
- any failure yields `{"error", "error_kind"}` as the last output (plus `"refresh_worker": True` after a CUDA fault
  that may have left the context unusable). Nothing raises out of `run` but GeneratorExit.
The worker's first result carries the engine's cold-start record (timing.ColdStart), into which the worker's own
phases (`boot`: SDK import, worker ready, first job) are written.
The job schemas (pydantic) are imported on first use, or earlier off the cold path (handler.py preloads them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from engine import timing
from engine.engine import Engine
from engine.errors import CudaError, EngineError
from engine.worker.limits import Limits

if TYPE_CHECKING:
    from engine.worker import jobs

log = logging.getLogger(__name__)

BAKED_MODEL = "/models/model.gguf"  # where the Docker image puts its model
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
            largest: int = STREAM_LARGEST) -> Iterator[dict]:  # fmt: skip
    """Merge the engine's per-token `{"text", "token_ids"}` chunks into batches of growing size."""
    it = iter(chunks)
    try:
        size, text, ids = first, [], []
        for chunk in it:
            text.append(chunk["text"])
            ids.extend(chunk["token_ids"])
            if len(ids) >= size:
                yield {"text": "".join(text), "token_ids": ids}
                size, text, ids = min(size * growth, largest), [], []
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

    @classmethod
    def load(cls, model_path: str | None = None) -> Worker:
        """Engine from `model_path`, else MODEL_PATH, else the image's baked model, else the bundled default.

        A failure to load is kept, not raised: every job then answers with it (typed), and the fitness check
        (`check_ready`) fails so the platform replaces the worker.
        """
        path = model_path or os.environ.get("MODEL_PATH") or (BAKED_MODEL if os.path.exists(BAKED_MODEL) else None)
        served = os.environ.get("SERVED_MODEL_NAME") or None
        try:
            limits = Limits.from_env()
            return cls(Engine.load(path), limits, served_name=served)
        except Exception as e:
            log.exception("the engine failed to load")
            err = e if isinstance(e, EngineError) else EngineError(error_output(e)["error"])
            return cls(None, Limits(), err, served)

    def check_ready(self) -> None:
        """Raises when the engine did not load (a Runpod fitness check)."""
        if self.engine is None:
            raise RuntimeError(f"the engine did not load: {self.load_error}")

    # -- jobs -------------------------------------------------------------------------------------------------

    def run(self, job_input: Any) -> Iterator[dict | str]:
        if not self._first_job_seen:
            self._first_job_seen = True
            self.boot["process_start_to_first_job_ms"] = timing.since_process_start_ms()
        if self.engine is None:
            yield error_output(self.load_error)
            return
        try:
            from engine.worker import jobs, openai_api

            job = jobs.parse(job_input, self.limits)
            if isinstance(job, jobs.System1Job):
                result = self.engine.system1(self._prompt(job), job.candidates, temperature=job.temperature)
                yield result
            elif isinstance(job, jobs.GenerateJob):
                yield from self._generate(self._prompt(job), job.sampling(self.limits), job.stream)
            elif isinstance(job, jobs.ModelsRequest):
                created = int(os.path.getmtime(self.engine.path))
                yield openai_api.models(self.served_name, created, self.engine.max_seq)
            else:
                yield from self._openai(job)
        except Exception as e:  # the worker keeps serving after every failure; GeneratorExit is not caught
            if not isinstance(e, EngineError):
                log.exception("internal error")
            yield error_output(e)

    def _prompt(self, job: jobs.System1Job | jobs.GenerateJob) -> str:
        if job.prompt is not None:
            return job.prompt
        return self.engine.apply_chat_template([m.for_template() for m in job.messages],
                                               **(job.chat_template_kwargs or {}))  # fmt: skip

    def _generate(self, prompt: str, sampling: dict, stream: bool) -> Iterator[dict]:
        if not stream:
            yield self.engine.generate(prompt, **sampling)
            return
        s = self.engine.generate_stream(prompt, **sampling)  # limits and context overflow raise here, before any yield
        yield from batches(s)
        yield s.result

    def _openai(self, req: jobs.ChatCompletionRequest | jobs.CompletionRequest) -> Iterator[dict | str]:
        from engine.worker import jobs, openai_api

        if isinstance(req, jobs.ChatCompletionRequest):
            prompt = self.engine.apply_chat_template([m.for_template() for m in req.messages],
                                                     **(req.chat_template_kwargs or {}))  # fmt: skip
        else:
            prompt = req.text
        sampling = req.sampling(req.requested_max_tokens or self._room(prompt))
        response = openai_api.Response(req.route, self.served_name)
        if not req.stream:
            yield response.complete(self.engine.generate(prompt, **sampling))
            return
        s = self.engine.generate_stream(prompt, **sampling)
        for batch in batches(s):
            if batch["text"]:
                yield openai_api.sse(response.chunk(batch["text"]))
        yield response.last_events(s.result, req.include_usage)

    def _room(self, prompt: str) -> int:
        """OpenAI's default max_tokens: whatever the context has left, up to MAX_NEW_TOKENS."""
        room = self.engine.max_seq - len(self.engine.tokenizer.encode(prompt))
        return max(1, min(self.limits.max_new_tokens, room))
