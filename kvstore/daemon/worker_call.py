"""WorkerCall: a call run on the daemon's worker threads, awaited on the loop under a bound.

``loop.run_in_executor`` plus ``asyncio.wait_for(asyncio.shield(...))`` costs four turns of
the event loop between a worker finishing and the waiting request going on: the worker's
future is copied into an asyncio future, that one into the shield's, the shield's into
``wait_for``'s waiter, and only then is the request's task woken; on an H200 host a copy
verb's reply went out ~0.18 ms after its worker returned (``benchmarks/request_trace.py``).
Here the worker's own completion callback schedules the wake-up of one waiter, so the task
goes on at the next turn.

The call is never cancelled by the wait: a wait that times out or is cancelled leaves the
call running (as ``shield`` did), and ``done``/``result``/``add_done_callback`` let the
caller finish it later.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class WorkerCall:
    """``fn(*args)`` submitted to ``executor`` now; create it on the event loop's thread."""

    def __init__(self, executor: Executor, fn: Callable[..., Any], *args: Any) -> None:
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None
        self.future: Future = executor.submit(fn, *args)  # RuntimeError once shut down
        self.future.add_done_callback(self._finished)

    def _finished(self, _: Future) -> None:
        """On the worker (or at once, if already done): wake the loop's waiter, if any."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> Any:
        """The call's result, or its exception raised (only once ``done()``)."""
        return self.future.result()

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        """``fn(future)`` once the call ended, on whichever thread ends it."""
        self.future.add_done_callback(fn)

    async def wait(self, timeout_s: float | None = None) -> Any:
        """The call's result (or its exception); TimeoutError once ``timeout_s`` passed with
        the call still running, which goes on. Cancelling this wait leaves the call running."""
        if not self.future.done():
            waiter = self._waiter = self._loop.create_future()
            timer = (self._loop.call_later(timeout_s, self._wake)
                     if timeout_s is not None else None)
            try:
                if not self.future.done():  # it may have ended before the waiter was set
                    await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self.future.done():
                raise asyncio.TimeoutError
        return self.future.result()
