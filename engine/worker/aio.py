"""The engine off the event loop: one thread advances every job a step at a time, so the SDK's loop stays free.

The SDK runs an async handler as a task on its asyncio loop; the job-take long-poll, the stop channel (cancels and
timeouts) and local servers share that loop. A handler that computed on the loop would hold all of them for the
whole job (a cancel would land when the job was already done). Here the job is a plain generator of outputs whose
every `next()` is at most one engine step (a prefill, one decode step, one system1 scoring); `EngineThread.drive`
runs each `next()` on the engine thread and awaits it. `None` from the generator means "a step done, nothing to
send": the loop gets control back, and a cancel raises `CancelledError` in the awaiting task at once. The job's
generator is then closed on the engine thread right after the step in flight, which releases the engine (its lock,
its sequence) before the next job's first step runs. Jobs take turns, in arrival order: a job's steps start once
the job before it has been closed (two interleaved jobs would wait on each other for the engine's lock), and a job
cancelled while it waits for its turn never starts.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_END = object()


class EngineThread:
    """A single worker thread for engine work (the engine serves one sequence at a time anyway)."""

    def __init__(self, name: str = "engine"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.closed_jobs = 0  # generators closed on the thread (finished, cancelled or abandoned)
        self._mutex = threading.Lock()
        self._busy = False  # a job holds the turn
        self._waiting: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()

    async def _take_turn(self) -> None:
        loop = asyncio.get_running_loop()
        with self._mutex:
            if not self._busy:
                self._busy = True
                return
            turn = loop.create_future()
            self._waiting.append((loop, turn))
        try:
            await turn  # a cancel here leaves a cancelled future, which _pass_turn skips
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted just as this job was cancelled: hand it on
                self._pass_turn()
            raise

    def _pass_turn(self) -> None:
        """The turn to the first waiting job still waiting (any thread), or free."""
        with self._mutex:
            while self._waiting:
                loop, turn = self._waiting.popleft()
                if not turn.cancelled():
                    loop.call_soon_threadsafe(self._grant, turn)
                    return
            self._busy = False

    def _grant(self, turn: asyncio.Future) -> None:
        if turn.done():  # cancelled after it was chosen: the next one's turn
            self._pass_turn()
        else:
            turn.set_result(None)

    async def drive(self, steps: Iterator[Any]) -> AsyncIterator[Any]:
        """Yield the non-None outputs of `steps`, each `next()` on the engine thread."""
        loop = asyncio.get_running_loop()
        try:
            await self._take_turn()
        except BaseException:
            steps.close()  # never started: closing runs none of its code
            raise
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
        try:
            close = getattr(steps, "close", None)
            if close is not None:
                close()
        finally:
            self.closed_jobs += 1
            self._pass_turn()

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
