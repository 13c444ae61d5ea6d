"""Every lease the daemon grants to a connection: its id, owner and deadline, and what it pins.

One table for every kind: a lease on store blocks (the store's ``Lease``), a hit with blocks in
other engines' HBM (``HbmHit``, whose store part may be None), or both. Ids are the table's own,
counted from 1 whatever the kind. A lease belongs to the connection that looked it up: only it
may load or release it, and it is released when that connection closes, when it is consumed
(``load``), or at its deadline. Thread-safe; the store's part is released outside the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.engines.hbm.tier import HbmHit
from kvstore.store.block_store import Lease


@dataclass(eq=False)
class GrantedLease:
    """A lease a connection holds: the store's part (``store_lease``), an HBM hit, or both."""

    lease_id: int
    owner: str
    expires_at: float  # time.monotonic() seconds
    store_lease: Lease | None
    hbm: HbmHit | None = None

    @property
    def num_blocks(self) -> int:
        if self.hbm is not None:
            return self.hbm.num_hit
        return len(self.store_lease.block_hashes) if self.store_lease is not None else 0

    def stale(self, now: float) -> bool:
        """Past its deadline; a store part keeps the store's own (capped) deadline."""
        if self.store_lease is not None:
            return self.store_lease.released or self.store_lease.expired(now)
        return now >= self.expires_at


class LeaseTable:
    """Leases by id, for connections that are open (``open_owner`` .. ``close_owner``)."""

    def __init__(self, release_store_lease: Callable[[Lease], None]) -> None:
        self._release_store_lease = release_store_lease
        self._lock = threading.Lock()
        self._leases: dict[int, GrantedLease] = {}
        self._owners: set[str] = set()
        self._next_id = 1

    def open_owner(self, owner: str) -> None:
        with self._lock:
            self._owners.add(owner)

    def close_owner(self, owner: str) -> int:
        """The connection closed: release every lease it holds; returns how many."""
        with self._lock:
            self._owners.discard(owner)
            leases = [g for g in self._leases.values() if g.owner == owner]
            for granted in leases:
                del self._leases[granted.lease_id]
        self._release_all(leases)
        return len(leases)

    @property
    def num_owners(self) -> int:
        with self._lock:
            return len(self._owners)

    def grant(self, owner: str, store_lease: Lease | None, hbm: HbmHit | None,
              ttl_s: float | None) -> int | None:
        """Hand the lease to ``owner`` for ``ttl_s`` (None: the store lease's own deadline):
        its id, or None if the connection closed while the lookup ran (then its store part is
        released here)."""
        if ttl_s is None:
            expires_at = store_lease.expires_at if store_lease is not None else time.monotonic()
        else:
            expires_at = time.monotonic() + ttl_s
        with self._lock:
            if owner in self._owners:
                lease_id = self._next_id
                self._next_id += 1
                self._leases[lease_id] = GrantedLease(lease_id, owner, expires_at, store_lease,
                                                      hbm)
                return lease_id
        self.release_untracked(store_lease)
        return None

    def get(self, lease_id: int, owner: str) -> GrantedLease | None:
        """``owner``'s lease ``lease_id``, or None (released, expired, never granted, or
        another connection's)."""
        with self._lock:
            granted = self._leases.get(lease_id)
        return granted if granted is not None and granted.owner == owner else None

    def drop(self, lease_id: int) -> GrantedLease | None:
        """Forget lease ``lease_id`` and release its store part; what it was, or None."""
        with self._lock:
            granted = self._leases.pop(lease_id, None)
        if granted is not None:
            self.release_untracked(granted.store_lease)
        return granted

    def release(self, lease_id: int, owner: str) -> bool:
        """``owner`` lets go of its lease; False if it holds no such lease."""
        return self.get(lease_id, owner) is not None and self.drop(lease_id) is not None

    def expire(self, now: float) -> int:
        """Drop (and release) every lease past its deadline; returns how many."""
        with self._lock:
            stale = [g for g in self._leases.values() if g.stale(now)]
            for granted in stale:
                del self._leases[granted.lease_id]
        self._release_all(stale)
        return len(stale)

    def count(self, owner: str | None = None) -> int:
        with self._lock:
            return sum(1 for g in self._leases.values() if owner is None or g.owner == owner)

    def clear(self) -> None:
        """Release every lease (the daemon is stopping)."""
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        self._release_all(leases)

    def release_untracked(self, store_lease: Lease | None) -> None:
        """Release a store lease the table never held (or no longer holds)."""
        if store_lease is not None:
            self._release_store_lease(store_lease)

    def _release_all(self, leases: list[GrantedLease]) -> None:
        for granted in leases:
            self.release_untracked(granted.store_lease)
