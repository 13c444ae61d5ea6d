"""Reporting blocks that left every tier of the tiered store to its ``on_dropped`` hook."""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict

from kvstore.keys import HASH_BYTES

log = logging.getLogger("kvstore.tiered_store")  # the store's logger, as before the split


class DropReporter:
    """Notes dropped keys under a lock and reports them, batched, outside it.

    A mixin: it uses the store's ``on_dropped``, ``_dropped``, ``_lock``, ``_blocks`` and ``_ssd``.
    """

    def _note_drop(self, key: bytes) -> None:
        """``key`` left a tier and may have left them all; under a lock (this store's or the
        SSD's), so it only takes note. A deque: appends and pops need no lock of their own."""
        if self.on_dropped is not None:
            self._dropped.append(key)

    def _report_dropped(self) -> None:
        """Tell ``on_dropped`` about the noted keys that no tier holds now, one call per
        namespace. Never called with the store's lock held. A key stored again since it was
        noted is still held and not reported (a block being written counts as held: its writer
        publishes it, or, should it abort, the index keeps a stale hint)."""
        keys: set[bytes] = set()
        with contextlib.suppress(IndexError):
            while True:
                keys.add(self._dropped.popleft())
        hook = self.on_dropped
        if not keys or hook is None:
            return
        with self._lock:
            gone = [k for k in keys if k not in self._blocks
                    and (self._ssd is None or self._ssd.lookup(k) is None)]
        by_namespace: defaultdict[bytes, list[bytes]] = defaultdict(list)
        for key in gone:
            by_namespace[key[:HASH_BYTES]].append(key[HASH_BYTES:])
        for namespace, hashes in by_namespace.items():
            try:
                hook(namespace, hashes)
            except Exception:  # a listener's failure never fails the store's caller
                log.exception("on_dropped hook failed")
