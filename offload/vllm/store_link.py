"""The connector's line to the daemon: one client, bounded waits, and a breaker.

Every request has a deadline. A request that misses it (a stopped daemon), or a broken connection
(a dead one), trips the breaker: the connection is closed (the daemon cancels what it still runs
for us) and no request is sent for ``retry_interval_s``; callers see a miss, a failed load or a
skipped save and vLLM recomputes. After the interval the next call reconnects and runs the
``on_connect`` hook again (the worker re-registers its memory there).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore import Client, ClientError, DaemonUnavailable, Pending

log = logging.getLogger("offload.vllm")


class Call:
    """One request in flight: ``poll()`` never blocks; ``wait()`` blocks at most to its deadline.

    Finishes exactly once with ``ok`` and ``result`` (the caller's fallback on failure).
    """

    def __init__(self, link: StoreLink | None, pending: Pending | None, deadline_s: float,
                 fallback: Any, generation: int = 0) -> None:
        self._link = link
        self._pending = pending
        self.deadline = time.monotonic() + deadline_s
        self.generation = generation  # the connection it was sent on
        self.fallback = fallback
        self.result: Any = fallback
        self.ok = False
        self.done = pending is None
        self.error = "" if pending is not None else "unavailable"

    def poll(self) -> bool:
        """True once finished; a reply, an error reply, a lost connection or the deadline."""
        if self.done:
            return True
        assert self._pending is not None
        if self._pending.poll():
            try:
                self.result, self.ok = self._pending.wait(0), True
            except ClientError as exc:
                self.error = exc.code
            except DaemonUnavailable:
                self.error = "unavailable"
                if self._link is not None:
                    self._link.trip("unavailable", self.generation)
            self._finish()
        elif time.monotonic() >= self.deadline:
            self.error = "deadline"
            if self._link is not None:
                self._link.trip("deadline", self.generation)
            self._finish()
        return self.done

    def wait(self) -> bool:
        """Block until finished (at most until the deadline); returns ``ok``."""
        if not self.done and self._pending is not None:
            with contextlib.suppress(ClientError, DaemonUnavailable, TimeoutError):
                self._pending.wait(max(0.0, self.deadline - time.monotonic()))
        while not self.poll():
            time.sleep(min(0.001, max(0.0, self.deadline - time.monotonic())))
        return self.ok

    def _finish(self) -> None:
        self.done = True
        self._pending = None
        if not self.ok:
            self.result = self.fallback


class StoreLink:
    """Owns the client; ``send`` returns a ``Call`` (failed at once while the breaker is open)."""

    def __init__(self, socket_path: str | Path | None, timeout_s: float = 5.0,
                 retry_interval_s: float = 2.0,
                 on_connect: Callable[[Client], None] | None = None) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.on_connect = on_connect
        self.counters: Counter[str] = Counter()
        self.generation = 0  # bumped per connection: calls of an old one cannot trip a new one
        self._client: Client | None = None
        self._retry_at = 0.0

    @property
    def connected(self) -> bool:
        if self._client is not None and self._client.is_closed:
            # Found closed while idle (the daemon went away between requests): no request
            # waited on it, so the next call may try a new connection at once.
            self.trip("unavailable", self.generation, pause=False)
        return self._client is not None

    def ensure(self) -> Client | None:
        """The client, connecting (rate-limited by the breaker) when there is none."""
        if self.connected:
            return self._client
        now = time.monotonic()
        if now < self._retry_at:
            return None
        self._retry_at = now + self.retry_interval_s
        client = None
        try:
            client = Client(self.socket_path, timeout_s=self.timeout_s)
            if self.on_connect is not None:
                self.on_connect(client)
        except (DaemonUnavailable, ClientError, OSError) as exc:
            if client is not None:
                with contextlib.suppress(OSError):
                    client.close()
            if self.counters["connect_failures"] == 0:
                log.warning("kvstore connector: store not available at %s (%s); recomputing "
                            "and retrying every %.1f s", self.socket_path, exc,
                            self.retry_interval_s)
            self.counters["connect_failures"] += 1
            return None
        self.generation += 1
        self._client = client
        self.counters["connects"] += 1
        if self.counters["connects"] > 1:
            log.warning("kvstore connector: reconnected to the store")
        return client

    def send(self, send: Callable[[Client], Pending], fallback: Any,
             deadline_s: float | None = None) -> Call:
        """Send one request; its ``Call`` fails (``fallback``) if the store is unavailable."""
        deadline_s = self.timeout_s if deadline_s is None else deadline_s
        client = self.ensure()
        if client is None:
            self.counters["skipped_unavailable"] += 1
            return Call(None, None, 0.0, fallback)
        try:
            pending = send(client)
        except (DaemonUnavailable, ClientError, OSError):
            self.trip("unavailable", self.generation)
            return Call(None, None, 0.0, fallback)
        return Call(self, pending, deadline_s, fallback, self.generation)

    def trip(self, code: str, generation: int, pause: bool = True) -> None:
        """A call failed by deadline or connection: drop this connection, pause the retries."""
        self.counters[f"errors_{code}"] += 1
        if generation != self.generation or self._client is None:
            return  # an old connection's call: already handled
        log.warning("kvstore connector: lost the store (%s); recomputing for %.1f s before "
                    "retrying", code, self.retry_interval_s)
        client, self._client = self._client, None
        if pause:
            self._retry_at = time.monotonic() + self.retry_interval_s
        with contextlib.suppress(OSError):
            client.close()

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(OSError):
                client.close()
