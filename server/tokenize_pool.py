"""TokenizePool: prompt preparation (chat template, tokenization) on a few worker threads.

On the event loop a 1 MB prompt stops every other connection for about a second; on a worker
thread it does not (PromptTokenizer releases the GIL for long pieces). The pool is bounded: at
most `max_pending` jobs run or wait, past that a request is refused as overloaded, so a flood of
large prompts cannot queue without limit.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class PoolFull(Exception):
    """`max_pending` jobs are already running or waiting."""


class TokenizePool:
    """Runs functions on `num_workers` threads; call `run` from the event loop only."""

    def __init__(self, num_workers: int = 2, max_pending: int = 64) -> None:
        if num_workers < 1 or max_pending < num_workers:
            raise ValueError(f"need 1 <= num_workers <= max_pending, got {num_workers}, "
                             f"{max_pending}")
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="kvengine-tokenize")
        self.num_workers = num_workers
        self.max_pending = max_pending
        self._num_pending = 0  # event loop thread only

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker; PoolFull at once when the pool is full. A
        cancelled caller stops waiting; the job itself runs to its end (it is bounded)."""
        if self._num_pending >= self.max_pending:
            raise PoolFull(f"{self._num_pending} prompts are being prepared; retry later")
        self._num_pending += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        future.add_done_callback(self._done)
        return await asyncio.shield(future)

    def _done(self, future: asyncio.Future) -> None:
        self._num_pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a caller that went away must not log it as lost

    def close(self) -> None:
        """Stop the workers after the jobs already queued."""
        self._executor.shutdown(wait=False, cancel_futures=True)
