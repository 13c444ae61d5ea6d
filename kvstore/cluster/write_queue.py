"""The cluster index's queued writes: what this node advertises and what Redis has not heard yet.

``ClusterIndex`` never calls Redis on a caller's thread. ``publish`` / ``unpublish`` / a stale
entry's deletion become events here, one per (namespace + block hash) key, the newest winning;
the index's thread takes them in batches, sends each batch as one script call, and acknowledges
it or puts it back (``requeue``) when Redis failed. The set of keys this node advertises is kept
beside them, so that a Redis that lost this node's registration can be told everything again
(``resync``).

Not thread-safe on its own: every method runs under the index's lock, which also guards the
condition the index's thread waits on. Invariants: at most ``max_events`` events are queued (the
oldest are dropped and counted); a key is queued at most once; ``in_flight`` events were taken
by a batch that Redis has not acknowledged yet.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from kvstore.cluster.redis_scripts import FORGET, PUBLISH, UNPUBLISH

Event = tuple[bytes, bytes]  # (op, entry): what the write script does with one key
Batch = list[tuple[bytes, Event]]


class WriteQueue:
    """Index writes waiting for Redis, oldest first, and the keys this node advertises."""

    def __init__(self, entry: bytes, max_events: int, counters: Counter[str]) -> None:
        """``entry``: this node's ``node_id/incarnation``; ``counters``: the index's."""
        self.entry = entry
        self.max_events = max_events
        self.counters = counters
        self.held: set[bytes] = set()  # namespace + hash of every block advertised
        self._events: dict[bytes, Event] = {}  # insertion order is age
        self.since = 0.0  # when the oldest event not yet in a batch was queued (or last sent)
        self.in_flight = 0

    def __len__(self) -> int:
        return len(self._events)

    def advertise(self, namespace: bytes, block_hashes: Sequence[bytes], held: bool) -> None:
        """Queue "this node holds (``held``) or no longer holds these blocks"; a block already
        advertised is not queued again."""
        event = (PUBLISH if held else UNPUBLISH, self.entry)
        num_events = 0
        for h in block_hashes:
            key = namespace + h
            if held:
                if key in self.held:  # advertised already (a save and a resident block)
                    continue
                self.held.add(key)
            else:
                self.held.discard(key)
            self._events.pop(key, None)
            self._events[key] = event
            num_events += 1
        self.counters["published" if held else "unpublished"] += num_events
        self._trim()

    def forget(self, stale: Iterable[tuple[bytes, bytes]]) -> None:
        """Queue the deletion of entries that look stale (the write script re-checks them);
        a key with an event of this node's queued keeps it."""
        num = 0
        for key, entry in stale:
            if key not in self._events:
                self._events[key] = (FORGET, entry)
            num += 1
        self.counters["stale_entries"] += num
        self._trim()

    def resync(self) -> None:
        """Redis lost this node's registration: queue every advertised block again."""
        event = (PUBLISH, self.entry)
        for key in self.held:
            self._events[key] = event
        if self._events:
            self.since = time.monotonic()

    def take(self, most: int) -> Batch:
        """The oldest ``most`` events, out of the queue and counted in flight."""
        batch = list(itertools.islice(self._events.items(), most))
        for key, _ in batch:
            del self._events[key]
        self.in_flight = len(batch)
        return batch

    def acknowledge(self, batch: Batch) -> None:
        """Redis applied ``batch``."""
        self.in_flight = 0
        self.counters["flush_batches"] += 1
        self.counters["flushed_events"] += len(batch)
        self.since = time.monotonic()

    def requeue(self, batch: Batch) -> None:
        """Redis did not apply ``batch``: its events go back in front, except those of keys
        queued again meanwhile (newer)."""
        rest = self._events
        self._events = dict(batch)
        self._events.update(rest)
        self.in_flight = 0

    def _trim(self) -> None:
        overflow = len(self._events) - self.max_events
        if overflow > 0:
            for key in list(itertools.islice(self._events, overflow)):
                del self._events[key]
            self.counters["dropped_events"] += overflow
        if not self.in_flight and len(self._events) == 1:
            self.since = time.monotonic()
