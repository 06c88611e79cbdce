"""Load-balancing endpoint mode: the same image, started with PORT set (and no RUNPOD_WEBHOOK_GET_JOB: a queue
worker never switches), serves HTTP itself (Starlette on uvicorn) instead of taking jobs from Runpod's queue.

    GET  /ping                  204 while the model loads, 200 once ready, 503 if it failed to load (Runpod's
                                load balancer routes to 200 only; the first 204 -> 200 is its cold-start metric)
    GET  /v1/models             POST /v1/chat/completions, /v1/completions: OpenAI's API (streams as SSE)
    POST /system1, /generate    the native jobs (docs/design.md §4), answered as JSON

Limits (a malformed setting is an `invalid_input` error naming it): a body over MAX_BODY_BYTES (default 8 MiB) is
413; more than MAX_QUEUE requests waiting or running (default 16) is 429 with Retry-After; a request running past
REQUEST_TIMEOUT seconds (default 300, under Runpod's 5.5 min) is 504 and its job is cancelled, which frees the
engine within one decode step (engine/worker/aio.py). Errors are OpenAI error objects on the OpenAI routes and
`{"error", "error_kind"}` on the native ones, with 400 for the request's faults and 500/503 for the server's.
PORT_HEALTH, when it differs from PORT, serves /ping there too.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.errors import env_int
from engine.worker import openai_api
from engine.worker.aio import EngineThread

log = logging.getLogger(__name__)

OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 8 << 20
    max_queue: int = 16
    request_timeout_s: int = 300

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HttpLimits:
        return cls(env_int("MAX_BODY_BYTES", cls.max_body_bytes, minimum=1, env=env),
                   env_int("MAX_QUEUE", cls.max_queue, minimum=1, env=env),
                   env_int("REQUEST_TIMEOUT", cls.request_timeout_s, minimum=1, env=env))  # fmt: skip


def _status(out: dict) -> int:
    return openai_api.error(out)[1]


class App:
    """The ASGI app around a worker that loads on a thread (`start_loading`), so /ping answers from the start."""

    def __init__(self, load: Callable, limits: HttpLimits):
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.load, self.limits = load, limits
        self.worker = None
        self.engine_thread = EngineThread()
        self.in_flight = 0
        routes = [Route("/ping", self.ping, methods=["GET"]), Route("/v1/models", self.models, methods=["GET"])]
        routes += [Route(r, self.openai, methods=["POST"]) for r in OPENAI_ROUTES]
        routes += [Route(r, self.native, methods=["POST"]) for r in ("/system1", "/generate")]
        self.asgi = Starlette(routes=routes)

    def start_loading(self) -> threading.Thread:
        def run() -> None:
            worker = self.load()
            importlib.import_module("engine.worker.openai_jobs")  # the first request's imports and schemas, now
            importlib.import_module("engine.worker.jobs").build()
            self.worker = worker

        thread = threading.Thread(target=run, name="model-load", daemon=True)
        thread.start()
        return thread

    # -- routes -----------------------------------------------------------------------------------------------

    async def ping(self, request):
        from starlette.responses import JSONResponse, Response

        if self.worker is None:
            return Response(status_code=204)
        if self.worker.engine is None:
            return JSONResponse({"status": "failed", "error": str(self.worker.load_error)}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def models(self, request):
        return await self._job(request, {"openai_route": "/v1/models"}, openai=True)

    async def openai(self, request):
        body = await self._body(request, openai=True)
        if not isinstance(body, dict):
            return body  # an error response
        return await self._job(request, {"openai_route": request.url.path, "openai_input": body}, openai=True,
                               stream=body.get("stream") is True)  # fmt: skip

    async def native(self, request):
        body = await self._body(request, openai=False)
        if not isinstance(body, dict):
            return body
        mode = request.url.path.strip("/")
        if "mode" in body and body["mode"] != mode:
            return self._error({"error": f"mode {body['mode']!r} on /{mode}", "error_kind": "invalid_input"}, False)
        return await self._job(request, {**body, "mode": mode}, openai=False, stream=body.get("stream") is True)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _error(self, out: dict, openai: bool, status: int | None = None):
        from starlette.responses import JSONResponse

        body, code = openai_api.error(out)
        return JSONResponse(body if openai else {"error": out["error"], "error_kind": out["error_kind"]},
                            status_code=status or code)  # fmt: skip

    async def _body(self, request, openai: bool):
        declared = request.headers.get("content-length")
        too_big = {"error": f"the request body is over MAX_BODY_BYTES ({self.limits.max_body_bytes})",
                   "error_kind": "invalid_input"}  # fmt: skip
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            return self._error(too_big, openai, 413)
        data = bytearray()
        async for part in request.stream():  # bounded read: a missing or false Content-Length cannot get past it
            data += part
            if len(data) > self.limits.max_body_bytes:
                return self._error(too_big, openai, 413)
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            return self._error({"error": f"the body is not JSON: {e}", "error_kind": "invalid_input"}, openai)
        if not isinstance(body, dict):
            return self._error({"error": "the body must be a JSON object", "error_kind": "invalid_input"}, openai)
        return body

    async def _job(self, request, job_input: dict, openai: bool, stream: bool = False):
        from starlette.responses import JSONResponse, StreamingResponse

        if self.worker is None:
            out = {"error": "the model is still loading", "error_kind": "internal"}
            return self._error(out, openai, 503)
        if self.in_flight >= self.limits.max_queue:
            out = {"error": f"over MAX_QUEUE ({self.limits.max_queue}) requests in flight", "error_kind": "internal"}
            response = self._error(out, openai, 429)
            response.headers["Retry-After"] = "1"
            return response
        self.in_flight += 1
        outputs = self.engine_thread.drive(self.worker.run(job_input))
        if stream:
            return StreamingResponse(self._stream(outputs), media_type="text/event-stream")

        async def collect() -> list:
            return [o async for o in outputs]

        try:
            collected = await asyncio.wait_for(collect(), self.limits.request_timeout_s)
        except asyncio.TimeoutError:
            out = {"error": f"the request ran past REQUEST_TIMEOUT ({self.limits.request_timeout_s} s)",
                   "error_kind": "internal"}  # fmt: skip
            return self._error(out, openai, 504)
        finally:
            await outputs.aclose()
            self.in_flight -= 1
        last = collected[-1]
        if isinstance(last, dict) and "error" in last:
            body = {"error": last["error"], "error_kind": last["error_kind"]}
            return JSONResponse(body, status_code=_status(last))
        return JSONResponse(last if len(collected) == 1 else collected)

    async def _stream(self, outputs):
        """The job's SSE text as it comes (native streams: one JSON line per output); ends at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.request_timeout_s
        try:
            while True:
                try:
                    out = await asyncio.wait_for(outputs.__anext__(), max(0.0, deadline - loop.time()))
                except StopAsyncIteration:
                    return
                if isinstance(out, str):
                    yield out
                elif isinstance(out, dict) and "error" in out:
                    yield openai_api.sse({"error": out["error"], "error_kind": out["error_kind"]})
                    return
                else:
                    yield json.dumps(out) + "\n"
        except asyncio.TimeoutError:
            yield openai_api.sse({"error": {"message": "REQUEST_TIMEOUT", "type": "timeout", "code": "timeout"}})
        finally:
            await outputs.aclose()
            self.in_flight -= 1


def port_from_env(env: Mapping[str, str] = os.environ) -> int | None:
    """The load-balancing mode's port (PORT), or None for the queue worker."""
    return env_int("PORT", 0, minimum=1, env=env) if (env.get("PORT") or "").strip() else None


def serve(load: Callable, host: str = "0.0.0.0", env: Mapping[str, str] = os.environ) -> None:
    """Serve until stopped (SIGTERM/SIGINT), the model loading meanwhile."""
    import uvicorn

    port = port_from_env(env)
    health = env_int("PORT_HEALTH", port, minimum=1, env=env)
    app = App(load, HttpLimits.from_env(env))
    app.start_loading()
    servers = [uvicorn.Server(uvicorn.Config(app.asgi, host=host, port=p, log_level="warning", access_log=False,
                                             lifespan="off")) for p in sorted({port, health})]  # fmt: skip

    async def run_all() -> None:
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(run_all())
