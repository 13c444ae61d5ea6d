"""Reporting blocks that left every tier of the tiered store to its drop listeners."""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from collections.abc import Callable

from kvstore.keys import HASH_BYTES
from kvstore.listeners import Listeners
from kvstore.store.block_store import DropListener


class DropReports:
    """Notes dropped keys under a lock and reports them, batched, outside it.

    ``still_gone(keys)``: the keys of ``keys`` that no tier holds now (it takes the store's
    lock itself). ``listeners``: told (namespace, block hashes) of those; while there are
    none, nothing is noted.
    """

    def __init__(self, still_gone: Callable[[set[bytes]], list[bytes]]) -> None:
        self.listeners: Listeners[DropListener] = Listeners("the store's dropped blocks")
        self._still_gone = still_gone
        self._dropped: deque[bytes] = deque()  # keys that may have left every tier

    def note(self, key: bytes) -> None:
        """``key`` left a tier and may have left them all; under a lock (the store's or the
        SSD's), so it only takes note. A deque: appends and pops need no lock of their own."""
        if self.listeners:
            self._dropped.append(key)

    @property
    def pending(self) -> bool:
        """Whether keys were noted and not yet reported."""
        return bool(self._dropped)

    def report(self) -> None:
        """Tell the listeners of the noted keys that no tier holds now, one call per namespace.
        Never called with the store's lock held. A key stored again since it was noted is
        still held and not reported (a block being written counts as held: its writer
        publishes it, or, should it abort, the index keeps a stale hint)."""
        keys: set[bytes] = set()
        with contextlib.suppress(IndexError):
            while True:
                keys.add(self._dropped.popleft())
        if not keys or not self.listeners:
            return
        by_namespace: defaultdict[bytes, list[bytes]] = defaultdict(list)
        for key in self._still_gone(keys):
            by_namespace[key[:HASH_BYTES]].append(key[HASH_BYTES:])
        for namespace, hashes in by_namespace.items():
            self.listeners.tell(namespace, hashes)  # a failure never fails the store's caller
