"""The tiered store's one lock, the condition its waiters sleep on, and whether it is closed.

Every part of the store (DRAM tier, write path, read path, demoter, promoter) is handed the same
guard: the lock guards the DRAM index, pool, policy, leases and counters together. Lock order:
this lock, then the SSD tier's.
"""

from __future__ import annotations

import threading

from kvstore.store.block_store import StoreError


class StoreGuard:
    """The store's lock (not reentrant) with its condition, and the closed flag it guards."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.closed = False

    def check_open(self) -> None:
        """StoreError once the store is closed; call with the lock held."""
        if self.closed:
            raise StoreError("the store is closed")
