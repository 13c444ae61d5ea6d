"""The engine's link to the store: register the KV arena, look up, load, save, publish evictions.

Everything here is asynchronous: each call returns a ``Transfer`` handle the step loop polls, and
no call waits on the daemon. A store that is down, slow or answering errors turns into misses,
failed transfers and counted errors, never into an exception in the step loop: the engine keeps
serving by recompute and the connector reconnects (and re-registers) when the daemon is back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore import Client, ClientError, DaemonUnavailable, Pending
from kvstore.layout import KVLayout

log = logging.getLogger("offload")

# The daemon answers by its deadline (after its copy thread stopped); the engine waits this much
# longer before it calls a request lost, so a late "failed" reply is still seen as a reply.
_DEADLINE_MARGIN_S = 2.0


class Transfer:
    """One request in flight: ``poll()`` is non-blocking; ``result`` is set once it is done.

    A request that fails (daemon gone, error reply, past its deadline) completes with
    ``ok=False`` and ``result`` the fallback the caller gave (a miss, zero blocks loaded...).
    """

    def __init__(self, pending: Pending | None, deadline_s: float, fallback: Any,
                 on_error: Callable[[str], None]) -> None:
        self._pending = pending
        self._deadline = time.monotonic() + deadline_s
        self._fallback = fallback
        self._on_error = on_error
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        self.done = pending is None
        self.ok = False
        self.timed_out = False  # no reply at all: the daemon may still touch the blocks
        self.result: Any = fallback
        if pending is None:
            self.finished_at = self.started_at

    def poll(self) -> bool:
        """True once finished (successfully or not); never blocks."""
        if self.done:
            return True
        assert self._pending is not None
        if self._pending.poll():
            try:
                self.result = self._pending.wait(0)
                self.ok = True
            except (ClientError, DaemonUnavailable) as exc:
                self._on_error(getattr(exc, "code", "unavailable"))
            self._finish()
        elif time.monotonic() >= self._deadline:
            self.timed_out = True
            self._on_error("deadline")
            self._finish()
        return self.done

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until done or ``timeout_s`` (default: the deadline): tests, shutdown, and the
        engine's bounded wait for lookup replies."""
        if self.done:
            return True
        assert self._pending is not None
        limit = max(0.0, self._deadline - time.monotonic())
        if timeout_s is not None:
            limit = min(limit, timeout_s)
        with contextlib.suppress(ClientError, DaemonUnavailable, TimeoutError):
            self._pending.wait(limit)
        return self.poll() or (time.monotonic() >= self._deadline and self.poll())

    @property
    def elapsed_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started_at

    def _finish(self) -> None:
        self.done = True
        self.finished_at = time.monotonic()
        self._pending = None


class OffloadConnector:
    """Owns the client connection and the registration of one engine's KV arena."""

    def __init__(self, socket_path: str | Path | None, layout: KVLayout, engine_id: str,
                 timeout_s: float = 10.0, reconnect_interval_s: float = 1.0) -> None:
        self.socket_path = socket_path
        self.layout = layout
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.counters: Counter[str] = Counter()
        self._client: Client | None = None
        self._registration_id: int | None = None
        self._next_attempt = 0.0
        self.connect()

    # ------------------------------------------------------------------------- connection

    @property
    def available(self) -> bool:
        """Connected and registered; tries to reconnect (rate-limited) when not."""
        if self._client is not None and self._client.is_closed:
            self._lost("unavailable")  # the daemon went away since the last request
        if self._client is None:
            self.connect()
        return self._client is not None

    def connect(self) -> bool:
        now = time.monotonic()
        if self._client is not None:
            return True
        if now < self._next_attempt:
            return False
        self._next_attempt = now + self.reconnect_interval_s
        try:
            client = Client(self.socket_path, timeout_s=self.timeout_s)
            self._registration_id = client.register(self.layout, self.engine_id)
        except (DaemonUnavailable, ClientError, OSError) as exc:
            if self.counters["connect_failures"] == 0:
                log.warning("kv offload: store not available (%s); serving without it and "
                            "retrying every %.1f s", exc, self.reconnect_interval_s)
            self.counters["connect_failures"] += 1
            return False
        self._client = client
        self.counters["connects"] += 1
        if self.counters["connects"] > 1:
            log.warning("kv offload: reconnected to the store (registration %d)",
                        self._registration_id)
        return True

    def _lost(self, code: str) -> None:
        self.counters[f"errors_{code}"] += 1
        if code in ("unavailable", "deadline") and self._client is not None:
            log.warning("kv offload: lost the store (%s); recomputing until it is back", code)
            client, self._client, self._registration_id = self._client, None, None
            with contextlib.suppress(OSError):
                client.close()

    def _request(self, send: Callable[[Client], Pending], fallback: Any,
                 deadline_s: float | None = None) -> Transfer:
        deadline_s = self.timeout_s if deadline_s is None else deadline_s
        if not self.available:
            self.counters["skipped_unavailable"] += 1
            return Transfer(None, 0.0, fallback, self._lost)
        assert self._client is not None
        try:
            pending = send(self._client)
        except (DaemonUnavailable, ClientError, OSError):
            self._lost("unavailable")
            return Transfer(None, 0.0, fallback, self._lost)
        return Transfer(pending, deadline_s + _DEADLINE_MARGIN_S, fallback, self._lost)

    # ------------------------------------------------------------------------------ verbs

    def lookup(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
               lease_ttl_s: float = 30.0) -> Transfer:
        """Result: (num_hit, tiers, lease_id); a failure is (0, [], None)."""
        self.counters["lookups"] += 1

        def send(c: Client) -> Pending:
            return c.lookup_async(namespace, hashes, idents, lease_ttl_s)

        transfer = self._request(send, None)
        return transfer

    def load(self, lease_id: int, block_ids: Sequence[int],
             deadline_s: float | None = None) -> Transfer:
        """Result: how many leading ``block_ids`` hold their block now; a failure is 0."""
        self.counters["loads"] += 1
        registration_id = self._registration_id

        def send(c: Client) -> Pending:
            return c.load_async(registration_id, lease_id, block_ids, deadline_s)

        return self._request(send, 0, deadline_s)

    def save(self, namespace: bytes, block_ids: Sequence[int], hashes: Sequence[bytes],
             idents: Sequence[bytes]) -> Transfer:
        """Result: per-block outcomes ("saved", "duplicate", "failed"); a failure is None."""
        self.counters["saves"] += 1
        registration_id = self._registration_id

        def send(c: Client) -> Pending:
            return c.save_async(registration_id, namespace, block_ids, hashes, idents)

        return self._request(send, None)

    def release(self, lease_id: int) -> None:
        """Give a lease back without waiting for the reply."""
        self._request(lambda c: c.request("release", {"lease_id": lease_id}), None)

    @property
    def registration_epoch(self) -> int:
        """Counts registrations made (one per connect): a new one starts with nothing published."""
        return self.counters["connects"]

    def resident(self, namespace: bytes, block_ids: Sequence[int], hashes: Sequence[bytes],
                 idents: Sequence[bytes], generations: Sequence[int]) -> None:
        """Publish blocks held in the arena, as of their generations (the store's HBM tier),
        without waiting for the reply."""
        if not block_ids:
            return
        self.counters["resident_published"] += len(block_ids)
        registration_id = self._registration_id

        def send(c: Client) -> Pending:
            return c.resident_async(registration_id, namespace, block_ids, hashes, idents,
                                    generations)

        self._request(send, None)

    def evicted(self, namespace: bytes, hashes: Sequence[bytes]) -> None:
        """Publish blocks the engine dropped from HBM, without waiting for the reply."""
        if not hashes:
            return
        self.counters["evictions_published"] += len(hashes)
        args = {"namespace": namespace, "hashes": list(hashes),
                "registration_id": self._registration_id}
        self._request(lambda c: c.request("evicted", args), None)

    def close(self) -> None:
        if self._client is not None:
            try:
                if self._registration_id is not None:
                    self._client.unregister(self._registration_id)
            except (DaemonUnavailable, ClientError, OSError):
                pass
            self._client.close()
            self._client = None
