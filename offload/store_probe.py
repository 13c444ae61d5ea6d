"""StoreProbe: the link's health probes of the daemon, and the deadline their round trips set.

One ``health`` request is out at a time, one every ``interval_s`` while connected. Their round
trips set ``deadline_s``, how long any wait on the daemon may last before the store counts as
hung: ``min_deadline_s``, or four times the slowest of the last ``_RTT_WINDOW`` on a loaded
machine, at most ``MAX_PROBE_DEADLINE_S``. A probe past ``min_deadline_s`` is late
(``probes_late``); on a clock shared with the daemon (its answer says when it answered) it is
also put where most of its time went: the daemon (``probes_late_daemon``), this process's
reading of the answer (``probes_late_engine``: the GIL, a collection), or the link's thread
(``probes_late_link``: busy, a send to a daemon that does not read included). The first of each
is logged with the three spans. Used by the link's thread only; ``sent_at`` and ``deadline_s``
are read from any thread (plain attributes).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, deque

from kvstore import Client, ClientError, DaemonUnavailable, Pending

log = logging.getLogger("offload")

# How often a connected link asks the daemon for ``health``, and how long an answer (or any
# other wait on the daemon) may take before the store counts as hung. Generous against a loaded
# machine; a request waits on a hung store about their sum at most.
PROBE_INTERVAL_S = 0.25
PROBE_DEADLINE_S = 0.75
# Where probes answered slowly, the deadline grows up to this (``StoreProbe.deadline_s``).
MAX_PROBE_DEADLINE_S = 5.0
_RTT_WINDOW = 20


class StoreProbe:
    """Health probes on one link's connection (see the module docstring)."""

    def __init__(self, counters: Counter[str], interval_s: float = PROBE_INTERVAL_S,
                 min_deadline_s: float = PROBE_DEADLINE_S) -> None:
        self.counters = counters
        self.interval_s = interval_s
        self.min_deadline_s = min_deadline_s
        self.daemon_pid: int | None = None  # from the last answer
        self.sent_at: float | None = None  # the probe out now was sent then
        self._pending: Pending | None = None
        self._rtts: deque[float] = deque(maxlen=_RTT_WINDOW)  # answered probes' times
        self._next_at = 0.0
        for side in ("daemon", "engine", "link"):  # present from the start, at zero
            counters[f"probes_late_{side}"] += 0

    @property
    def deadline_s(self) -> float:
        """How long a wait on the daemon may last before the store counts as hung."""
        slowest = max(self._rtts, default=0.0)
        return min(MAX_PROBE_DEADLINE_S, max(self.min_deadline_s, 4 * slowest))

    def due(self, now: float) -> bool:
        """No probe out, and the interval since the last answer has passed."""
        return self._pending is None and now >= self._next_at

    def sent(self, pending: Pending, now: float) -> None:
        """A probe went out at ``now``; ``collect`` takes its answer."""
        self._pending, self.sent_at = pending, now
        self.counters["probes"] += 1

    def start_over(self, now: float) -> None:
        """A connection is new, or gone: nothing out; the next probe is due at ``now``."""
        self._pending = self.sent_at = None
        self._next_at = now

    def collect(self, client: Client, now: float) -> None:
        """Take the answer of the probe out, if it came: its round trip, late or not."""
        if self._pending is None or not self._pending.poll():
            return  # still out: the store turns hung once it is overdue
        answer: dict = {}
        with contextlib.suppress(ClientError, DaemonUnavailable):
            answer = self._pending.wait(0)
            self.daemon_pid = answer.get("pid")
        landed_at = self._pending.landed_at or now
        assert self.sent_at is not None
        rtt = now - self.sent_at
        self._rtts.append(rtt)
        if rtt > self.min_deadline_s:
            self.counters["probes_late"] += 1  # slow, yet not taken for hung
            self._count_late_side(client, answer, landed_at, now)
        self._pending = self.sent_at = None
        self._next_at = now + self.interval_s

    def _count_late_side(self, client: Client, answer: dict, landed_at: float,
                         now: float) -> None:
        mono = answer.get("mono")
        if type(mono) not in (int, float) or not client.clock_shared or self.sent_at is None:
            return
        spans = {"daemon": mono - self.sent_at, "engine": landed_at - mono,
                 "link": now - landed_at}
        side = max(spans, key=spans.__getitem__)
        self.counters[f"probes_late_{side}"] += 1
        if self.counters[f"probes_late_{side}"] == 1:
            log.warning("kv offload: a store probe took %.0f ms: %.0f ms to the daemon's "
                        "answer, %.0f ms until it was read, %.0f ms until the link thread "
                        "took it", 1e3 * (now - self.sent_at), 1e3 * spans["daemon"],
                        1e3 * spans["engine"], 1e3 * spans["link"])
