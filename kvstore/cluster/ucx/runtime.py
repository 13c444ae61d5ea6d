"""The process's one UCX runtime: an asyncio loop in a dedicated thread that owns every ucxx call.

ucxx keeps one application context (one UCX worker) per process, and its request notifier binds to
the event loop that was running when the context was created. So every peer server and client of
the process shares one runtime, reference-counted: the first ``acquire()`` starts the thread and
initialises ucxx inside its loop, the last ``release()`` resets ucxx and stops the thread. Callers
on other threads hand coroutines over with ``submit`` (a ``concurrent.futures.Future``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0


class UcxRuntime:
    """The shared loop thread; get it with ``UcxRuntime.acquire()``, give it back with
    ``release()``."""

    _lock = threading.Lock()
    _instance: UcxRuntime | None = None
    _refs = 0

    @classmethod
    def acquire(cls) -> UcxRuntime:
        """The running runtime, started on first use; each call needs one ``release()``."""
        with cls._lock:
            if cls._instance is None:
                runtime = cls()
                runtime._start()
                cls._instance = runtime
            cls._refs += 1
            return cls._instance

    def release(self) -> None:
        """Drop one reference; the last one stops the loop and resets ucxx."""
        cls = type(self)
        with cls._lock:
            if cls._instance is not self or cls._refs <= 0:
                return
            cls._refs -= 1
            if cls._refs:
                return
            cls._instance = None
        self._stop()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvstore-ucx", daemon=True)
        self._ready = concurrent.futures.Future[None]()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the runtime's loop; safe from any thread but the loop's own."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """``submit`` and wait; on timeout the coroutine is cancelled and TimeoutError raised.
        Never from the loop's own thread (it would wait on itself)."""
        if self.in_loop():
            coro.close()
            raise RuntimeError("UcxRuntime.call from the UCX loop thread would deadlock")
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"UCX call did not finish within {timeout_s:.3f} s") from None

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    # -- thread --------------------------------------------------------------------------------

    def _start(self) -> None:
        # A restarted daemon must re-bind its --listen port while connections of its previous
        # life sit in TIME_WAIT; UCX's TCP connection manager binds without SO_REUSEADDR unless
        # told. An operator's own setting wins.
        os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
        self._thread.start()
        self._ready.result(_START_TIMEOUT_S)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._init_ucx())
        except BaseException as exc:  # reported to acquire(); nothing else to do here
            self._ready.set_exception(exc)
            self.loop.close()
            return
        self._ready.set_result(None)
        self.loop.run_forever()
        self.loop.close()

    async def _init_ucx(self) -> None:
        import ucxx

        try:
            ucxx.init(progress_mode="thread", enable_python_future=True)
        except RuntimeError:
            log.warning("ucxx was initialised outside kvstore; sharing its context")

    def _stop(self) -> None:
        future = self.submit(self._shutdown_ucx())
        try:
            future.result(_STOP_TIMEOUT_S)
        except Exception as exc:  # a leaked endpoint keeps the context; the process goes on
            log.warning("ucxx did not shut down cleanly: %s", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(_STOP_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("the UCX loop thread did not stop within %.1f s", _STOP_TIMEOUT_S)

    async def _shutdown_ucx(self) -> None:
        import ucxx

        await asyncio.sleep(0)  # let closing endpoints run their last callbacks
        ucxx.stop_notifier_thread()
        ucxx.reset()
