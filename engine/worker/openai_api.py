"""OpenAI response shapes for the worker's `openai_route` jobs: completions, their stream chunks, the model list.

Objects follow OpenAI's API (`id`, `object`, `created`, `model`, `choices`, `usage`); the engine's own fields
(`timings`, `cold_start`, `backend`, `model_info`) ride along as extra keys, which OpenAI clients ignore. Streams are
server-sent-event text: `data: {json}\\n\\n` per chunk, ending with `data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import json
import os
import time

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class Response:
    """One request's id, creation time and served model name, shared by all its chunks."""

    def __init__(self, route: str, model: str):
        self.chat = route == CHAT
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + os.urandom(12).hex()
        self.created = int(time.time())
        self.model = model
        self._role_sent = False

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}  # fmt: skip

    def complete(self, result: dict, logprobs: dict | None = None, reasoning: tuple[str | None, str] | None = None,
                 ) -> dict:  # fmt: skip
        """The non-streamed response for an engine generate result (`reasoning`: (reasoning_content, content))."""
        if self.chat:
            message = {"role": "assistant", "content": result["text"]}
            if reasoning is not None and reasoning[0] is not None:
                message.update(reasoning_content=reasoning[0], content=reasoning[1])
            choice = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": result["text"]}
        choice.update(logprobs=logprobs, finish_reason=result["finish_reason"])
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [choice], usage=usage(result), **engine_fields(result))

    def chunk(self, text: str, finish_reason: str | None = None, logprobs: dict | None = None,
              reasoning: str = "") -> dict:  # fmt: skip
        """A stream chunk carrying `text` (the first chat chunk also names the role; `reasoning`: a
        reasoning_content delta)."""
        if self.chat:
            delta = {"content": text} if text or (finish_reason is None and not reasoning) else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if not self._role_sent:
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def last_events(self, result: dict, include_usage: bool) -> str:
        """The closing SSE text: the finish chunk (with the engine's fields), the usage chunk if asked, [DONE]."""
        final = self.chunk("", result["finish_reason"])
        final.update(engine_fields(result))
        events = [final]
        if include_usage:
            events.append(self._object(final["object"], [], usage=usage(result)))
        return "".join(sse(e) for e in events) + "data: [DONE]\n\n"


# error_kind -> (OpenAI error type, HTTP status): the request's fault or the server's
_ERROR_TYPES = {"invalid_input": ("invalid_request_error", 400), "context_overflow": ("invalid_request_error", 400),
                "tokenizer": ("invalid_request_error", 400), "out_of_memory": ("server_error", 503)}  # fmt: skip


def error(out: dict) -> tuple[dict, int]:
    """OpenAI's error body (`{"error": {message, type, param, code}}`) for an `{"error", "error_kind"}` output, with
    the HTTP status an OpenAI server would answer; `code` is the engine's error kind (context overflow: OpenAI's
    own `context_length_exceeded`)."""
    kind = out["error_kind"]
    err_type, status = _ERROR_TYPES.get(kind, ("server_error", 500))
    code = "context_length_exceeded" if kind == "context_overflow" else kind
    return {"error": {"message": out["error"], "type": err_type, "param": None, "code": code}}, status


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def usage(result: dict) -> dict:
    u = result["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}  # fmt: skip


def engine_fields(result: dict) -> dict:
    return {"timings": result["timings"], "cold_start": result["cold_start"], "backend": result["backend"],
            "model_info": result["model"]}  # fmt: skip


def models(name: str, created: int, max_model_len: int) -> dict:
    """GET /v1/models: the one model this worker serves."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "reflex", "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}
