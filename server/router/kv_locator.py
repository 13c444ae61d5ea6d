"""KVLocator: the router's one connection to the kvstore daemon, asked ``locate`` with a bound.

A daemon that is down, hung (SIGSTOP) or slow costs a request at most ``timeout_s`` and routing
by load instead, never an error: ``locate`` returns None, the state (a ``StoreState``, told from
how the request ended by ``StoreState.after_failure``: no answer within the bound
is hung) says why, and the daemon is left alone for ``retry_after_s`` (requests in between do
not wait at all) before it is asked again. The blocking client connects and sends on a few
threads of its own; its reader thread hands the reply to the event loop, which only awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore import Client, ClientError, DaemonUnavailable, LocateReply, Pending, StoreState
from server.router.prompt_chain import PromptChain

logger = logging.getLogger("kvengine.router")


class KVLocator:
    """``await locate(chain)``: the daemon's LocateReply, or None within ``timeout_s``."""

    def __init__(self, socket_path: str | Path | None, timeout_s: float = 0.05,
                 retry_after_s: float = 1.0, num_threads: int = 4) -> None:
        if timeout_s <= 0 or retry_after_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_after_s >= 0")
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.state = StoreState.UNKNOWN
        self._client: Client | None = None
        self._lock = threading.Lock()  # guards _client and the state changes below
        self._skip_until = 0.0
        self._threads = ThreadPoolExecutor(max_workers=num_threads,
                                           thread_name_prefix="kv-locate")

    async def locate(self, chain: PromptChain) -> LocateReply | None:
        """Where the chain's leading blocks are; None (counted by the caller as a fallback)
        when the daemon is skipped, down, hung or refuses."""
        if time.monotonic() < self._skip_until:
            return None
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def land(outcome: Pending | BaseException) -> None:  # any thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, answer, outcome)

        # Connecting and sending may block (a daemon that stopped reading fills the socket), so
        # the loop only sends on a connected client, as far as its socket takes the frame at
        # once (the rest, if any, on one of our threads); otherwise one of our threads connects
        # and sends. The reply wakes the loop straight from the client's reader thread, with no
        # thread in between waiting for it.
        if not self._send_now(chain, land):
            self._threads.submit(self._send, chain, land)
        try:
            outcome = await asyncio.wait_for(answer, self.timeout_s)
        except asyncio.TimeoutError:
            outcome = TimeoutError("no answer in time")
        return self._read(outcome)

    async def engines(self) -> list[dict] | None:
        """The daemon's registered engines (``Client.engines``), or None when it does not
        answer within ``timeout_s`` (or is being skipped)."""
        if time.monotonic() < self._skip_until:
            return None
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._threads, self._engines), self.timeout_s * 4)
        except (asyncio.TimeoutError, ClientError, DaemonUnavailable, OSError):
            return None

    def _engines(self) -> list[dict]:
        return self._connected().engines_async(self.timeout_s * 4).wait(self.timeout_s * 4)

    def _send_now(self, chain: PromptChain,
                  land: Callable[[Pending | BaseException], None]) -> bool:
        """Send on the loop if that cannot block; False when a thread must do it."""
        with self._lock:
            client = self._client
        if client is None or client.is_closed:
            return False
        try:
            pending = client.locate_nowait(chain.namespace, chain.hashes, chain.idents,
                                           self.timeout_s, self._threads.submit)
        except Exception as exc:  # the connection failed under the send
            land(exc)
            return True
        if pending is None:
            return False
        pending.add_done_callback(land)
        return True

    def _send(self, chain: PromptChain,
              land: Callable[[Pending | BaseException], None]) -> None:
        try:
            client = self._connected()
            pending = client.locate_async(chain.namespace, chain.hashes, chain.idents,
                                          timeout_s=self.timeout_s)
        except Exception as exc:  # not connected, or the connection failed under the send
            land(exc)
            return
        pending.add_done_callback(land)

    def _read(self, outcome: Pending | BaseException) -> LocateReply | None:
        """The landed reply, or None with the state (and the skip) saying why."""
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            reply = outcome.wait(0)
        except (ClientError, DaemonUnavailable, OSError) as exc:  # TimeoutError among them
            state = StoreState.after_failure(exc)
            if state is StoreState.REFUSED:  # answered, quickly: no reason to stop asking
                if self.state is not state:
                    logger.warning("kvstore daemon refused locate (%s); routing by load", exc)
                self.state = state
            else:
                self._failed(state, exc)
            return None
        self.state = StoreState.OK
        return reply

    def _connected(self) -> Client:
        with self._lock:
            client = self._client
            if client is None or client.is_closed:
                client = self._client = Client(self.socket_path, timeout_s=self.timeout_s)
            return client

    def _failed(self, state: StoreState, exc: BaseException) -> None:
        """Skip the daemon for a while; a hung or broken connection is dropped (its waiters
        fail at once) and made anew on the next try."""
        with self._lock:
            if self.state is not state:
                logger.warning("kvstore daemon at %s: %s (%s); routing by load for %.1f s",
                               self.socket_path or "the default socket", state.value, exc,
                               self.retry_after_s)
            self.state = state
            self._skip_until = time.monotonic() + self.retry_after_s
            client, self._client = self._client, None
        if client is not None:
            threading.Thread(target=client.close, name="kv-locate-close", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _settle(answer: asyncio.Future, outcome: Pending | BaseException) -> None:
    if not answer.done():  # else the wait timed out first
        answer.set_result(outcome)
