"""The connection watch: on a timer, closes slow readers, idle connections, and (when the
buffer budget is spent) the connections holding more than their share of it.

A slow reader is a connection whose unread replies have not shrunk for
``slow_reader_timeout_s``; an idle one has had nothing in flight and nothing sent for
``idle_timeout_s``. Each closure is counted by reason, and after closures the freed memory is
handed back to the system. Waiters for room (a large frame) are woken every tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable, Iterable

from kvstore.daemon import memory
from kvstore.daemon.connection import Connection
from kvstore.daemon.limits import ConnectionLimits

log = logging.getLogger("kvstore.daemon.watch")

# Counted closures, by reason (the daemon's events, present from the start).
CLOSE_REASONS = ("slow_reader", "idle", "over_budget")


class ConnectionWatch:
    """Sweeps the daemon's connections; ``room`` wakes whoever waits for buffer budget."""

    def __init__(self, limits: ConnectionLimits, count: Callable[[str], None]) -> None:
        self.limits = limits
        self._count = count  # count(event name)
        self._room = asyncio.Event()
        self._release_wanted = False
        self.tick_s = max(0.05, min(0.25, limits.slow_reader_timeout_s / 4,
                                    limits.idle_timeout_s / 4, limits.frame_timeout_s / 4))

    @staticmethod
    def buffered_bytes(connections: Iterable[Connection]) -> int:
        return sum(c.buffered_bytes() for c in connections)

    async def wait_for_room(self, timeout_s: float) -> None:
        """Until the next sweep (or ``timeout_s``): then check the budget again."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._room.wait(), timeout_s)

    def request_release(self) -> None:
        """A connection that held large buffers closed: give the memory back at the next tick."""
        self._release_wanted = True

    async def run(self, connections: Callable[[], list[Connection]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                if self.sweep(connections(), loop.time()):
                    await asyncio.sleep(0)  # let the aborted transports drop their buffers
                    self._release_wanted = True
                elif self._release_wanted:
                    self._release_wanted = False
                    # A closed connection's buffers can sit in reference cycles (an exception's
                    # traceback holding a partial frame) until the cyclic collector runs.
                    gc.collect()
                    memory.trim()
            except Exception:
                log.exception("connection sweep failed")
            room, self._room = self._room, asyncio.Event()
            room.set()

    def sweep(self, connections: list[Connection], now: float) -> int:
        """Close what must go; returns how many were closed."""
        limits = self.limits
        num_closed = 0
        for conn in connections:
            if conn.stalled_for(now) > limits.slow_reader_timeout_s:
                num_closed += self._close(conn, "slow_reader")
            elif conn.is_idle() and now - conn.last_activity > limits.idle_timeout_s:
                num_closed += self._close(conn, "idle")
        live = [c for c in connections if c.closed_reason is None]
        total = self.buffered_bytes(live)
        if total <= limits.max_buffered_bytes:
            return num_closed
        holders = [c for c in live if c.unread_bytes() > 0]
        share = limits.max_buffered_bytes // max(1, len(holders))
        for conn in sorted(holders, key=Connection.unread_bytes, reverse=True):
            held = conn.buffered_bytes()
            if total <= limits.max_buffered_bytes or conn.unread_bytes() <= share:
                break
            num_closed += self._close(conn, "over_budget")
            total -= held
        return num_closed

    def _close(self, conn: Connection, reason: str) -> int:
        if conn.closed_reason is not None:
            return 0
        log.info("closing %s: %s (%d B unread)", conn.owner, reason, conn.unread_bytes())
        conn.abort(reason)
        self._count(f"connections_closed_{reason}")
        return 1
