"""The engine off the event loop: one thread advances every job a step at a time, so the SDK's loop stays free.

The SDK runs an async handler as a task on its asyncio loop; the job-take long-poll, the stop channel (cancels and
timeouts) and local servers share that loop. A handler that computed on the loop would hold all of them for the
whole job (a cancel would land when the job was already done). Here the job is a plain generator of outputs whose
every `next()` is at most one engine step (a prefill, one decode step, one system1 scoring); `EngineThread.drive`
runs each `next()` on the engine thread and awaits it. `None` from the generator means "a step done, nothing to
send": the loop gets control back, and a cancel raises `CancelledError` in the awaiting task at once. The job's
generator is then closed on the engine thread right after the step in flight, which releases the engine (its lock,
its sequence) before the next job's first step runs: jobs queue on that one thread, in order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_END = object()


class EngineThread:
    """A single worker thread for engine work (the engine serves one sequence at a time anyway)."""

    def __init__(self, name: str = "engine"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.closed_jobs = 0  # generators closed on the thread (finished, cancelled or abandoned)

    async def drive(self, steps: Iterator[Any]) -> AsyncIterator[Any]:
        """Yield the non-None outputs of `steps`, each `next()` on the engine thread."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                out = await loop.run_in_executor(self._pool, next, steps, _END)
                if out is _END:
                    return
                if out is not None:
                    yield out
        finally:
            # Done, cancelled, or abandoned by the consumer: close the job after whatever step is in flight.
            self._pool.submit(self._close, steps)

    def _close(self, steps: Iterator[Any]) -> None:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
        self.closed_jobs += 1

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once the last job's generator has been closed (tests: the engine is free again)."""
        done = threading.Event()
        self._pool.submit(done.set)
        return done.wait(timeout)


def collect(handler, job: dict) -> list:
    """All outputs of an async generator handler for one job, on a private event loop (tests, local test mode)."""

    async def run() -> list:
        return [out async for out in handler(job)]

    return asyncio.run(run())
