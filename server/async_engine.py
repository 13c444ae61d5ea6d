"""AsyncEngine: runs LLMEngine.step() on its own thread and streams outputs to asyncio callers."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.engine_protocol import EngineOutput, EngineStats, ServedEngine

if TYPE_CHECKING:
    from engine import SamplingParams

logger = logging.getLogger("kvengine.server")

# An idle step thread wakes this often to do what the engine leaves for idle time
# (``ServedEngine.use_idle_time``: cuDNN graphs built in the background, loaded before a request
# meets them); it returns at once when there is nothing to do.
IDLE_WORK_INTERVAL_S = 0.05


class EngineOverloaded(Exception):
    """Admitting the request would exceed the bounded queue; the client should retry later."""


class EngineDead(Exception):
    """The step loop stopped after an error; no request can be served any more."""


@dataclass(frozen=True)
class EngineRequest:
    """One engine request: a prompt's token ids, its sampling params and its tenant salt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    grammar: Any = None  # the engine's compile_grammar result, compiled off the loop


class RequestGroup:
    """The engine requests of one HTTP request (n samples x prompts), sharing one output queue.

    Iterating yields every RequestOutput of every member until all have finished. `close()`
    aborts the members that have not finished; call it in a `finally` (disconnects land there).
    """

    def __init__(self, owner: AsyncEngine, request_ids: Sequence[str]) -> None:
        self._owner = owner
        self.request_ids = tuple(request_ids)
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._closed = False

    @property
    def finished(self) -> bool:
        """True when every member has delivered its final output."""
        return not self._unfinished

    def __aiter__(self) -> AsyncIterator[EngineOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[EngineOutput]:
        while self._unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield item

    def close(self) -> list[str]:
        """Abort the unfinished members and release the group's slots; returns the aborted ids."""
        if self._closed:
            return []
        self._closed = True
        aborted = sorted(self._unfinished)
        self._unfinished.clear()
        self._owner._release(self, aborted)
        return aborted


class AsyncEngine:
    """Owns the step thread. The event loop thread admits and aborts; the step thread steps.

    The step thread sleeps on a condition variable while the engine has nothing to do, so an idle
    server burns no CPU. All group bookkeeping happens on the event loop: the step thread hands
    each step's outputs over with one `call_soon_threadsafe`.
    """

    def __init__(self, engine: ServedEngine, max_in_flight: int,
                 on_finished: Callable[[EngineOutput], None] | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self._on_finished = on_finished  # every request's last output, on the event loop
        self._on_step = on_step  # tokens each step computed, on the step thread
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._groups: dict[str, RequestGroup] = {}  # request id -> group; event loop thread only
        self._num_in_flight = 0
        self.error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvengine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop stepping after the current step and join the thread; streams still open end
        with EngineDead (uvicorn drains requests before the lifespan calls this)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        for group in list(self._groups.values()):
            group.queue.put_nowait(EngineDead("server is shutting down"))

    @property
    def alive(self) -> bool:
        """True while the step thread runs without having hit an error."""
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Engine requests admitted and not yet finished or aborted."""
        return self._num_in_flight

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (ServedEngine.stats() is thread-safe)."""
        return self.engine.stats()

    # ---- event loop side -------------------------------------------------------------------
    def has_room(self, num_requests: int) -> bool:
        """Whether `num_requests` more engine requests would be admitted now."""
        return self._num_in_flight + num_requests <= self.max_in_flight

    def never_fits(self, num_requests: int) -> str | None:
        """Why one HTTP request of `num_requests` engine requests (prompts x n) can never be
        admitted, whatever the load; None when it can. Retrying cannot help it: a 400, not a
        503."""
        if num_requests <= self.max_in_flight:
            return None
        return (f"this request asks for {num_requests} sequences (prompts x n); the server "
                f"admits at most {self.max_in_flight} at once (--max-num-seqs plus "
                "--max-queue): send fewer in one request")

    def submit(self, requests: Sequence[EngineRequest]) -> RequestGroup:
        """Admit all of `requests` or none: EngineOverloaded when the queue is full, ValueError
        for more requests than ever fit (``never_fits``) or from the engine for a prompt it
        cannot take, EngineDead after a step-loop failure."""
        if not self.alive:
            raise EngineDead(f"engine is not running: {self.error!r}")
        too_many = self.never_fits(len(requests))
        if too_many:
            raise ValueError(too_many)
        if self._num_in_flight + len(requests) > self.max_in_flight:
            raise EngineOverloaded(
                f"server is overloaded: {self._num_in_flight} requests in flight, "
                f"limit {self.max_in_flight}; retry later")
        group = RequestGroup(self, [r.request_id for r in requests])
        added: list[str] = []
        try:
            with self._cond:
                for r in requests:
                    self._groups[r.request_id] = group
                    self.engine.add_request(r.request_id, r.prompt_token_ids, r.params,
                                            cache_salt=r.cache_salt, grammar=r.grammar)
                    added.append(r.request_id)
                self._cond.notify()
        except BaseException:
            with self._cond:
                for request_id in added:
                    self.engine.abort_request(request_id)
                self._cond.notify()
            for r in requests:
                self._groups.pop(r.request_id, None)
            raise
        self._num_in_flight += len(requests)
        return group

    def _release(self, group: RequestGroup, aborted: Sequence[str]) -> None:
        if aborted:
            with self._cond:
                for request_id in aborted:
                    self.engine.abort_request(request_id)
                self._cond.notify()
        for request_id in group.request_ids:
            self._groups.pop(request_id, None)
        self._num_in_flight -= len(group.request_ids)

    def _dispatch(self, outputs: Sequence[EngineOutput]) -> None:
        for out in outputs:
            if out.finished and self._on_finished is not None:
                self._on_finished(out)
            group = self._groups.get(out.request_id)
            if group is not None:  # None: aborted by its client, output arrived late
                group.queue.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for group in set(self._groups.values()):
            group.queue.put_nowait(EngineDead(f"engine step failed: {exc!r}"))

    # ---- step thread -----------------------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        while True:
            with self._cond:
                while not self._stop and not self.engine.has_unfinished_requests():
                    if not self._cond.wait(IDLE_WORK_INTERVAL_S):
                        break
                if self._stop:
                    return
                idle = not self.engine.has_unfinished_requests()
            try:
                if idle:  # outside the lock: an arrival's notify never waits for it
                    self.engine.use_idle_time()
                    continue
                outputs = self.engine.step()
                last_step = getattr(self.engine, "last_step", None)
                if self._on_step is not None and last_step is not None:
                    self._on_step(int(last_step.num_tokens))
                if outputs:
                    loop.call_soon_threadsafe(self._dispatch, outputs)
                # Hand the GIL to the event loop now rather than after the switch interval
                # (5 ms), so the outputs just dispatched reach the socket before the store work
                # and the next step.
                time.sleep(0)
                self.engine.flush_offload()  # the step's store work, after its tokens went out
            except BaseException as exc:
                logger.exception("engine step failed; the server stops serving requests")
                self.error = exc
                loop.call_soon_threadsafe(self._fail_all, exc)
                return
