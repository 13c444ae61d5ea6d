"""The store's leases as pins: granting one over found blocks, letting go on release or expiry.

Runs under the store's lock. DRAM blocks of a new lease are held lazily (``DramTier``); SSD
entries are pinned by the caller before the grant (a pin can fail there) and unpinned here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvstore.store.block_store import Lease, Tier
from kvstore.store.leases import HeldLease, LeaseTable
from kvstore.store.parts import StoreParts


class LeasePins:
    """The store's live leases, what each pins, and the letting go of it."""

    def __init__(self, parts: StoreParts, table: LeaseTable) -> None:
        self._guard = parts.guard
        self._dram = parts.dram
        self._backing = parts.backing
        self._table = table
        self._counters = parts.counters

    def grant(self, namespace: bytes, block_hashes: Sequence[bytes], tiers: list[Tier],
              dram: list, ssd: list, ttl_s: float, owner: str, has_dram: bool) -> Lease:
        """A lease over found blocks: ``dram`` blocks (some, if ``has_dram``) held lazily,
        ``ssd`` entries already pinned by the caller."""
        lease = self._table.grant(namespace, block_hashes, tiers, dram, ssd, ttl_s, owner)
        if has_dram:
            self._dram.hold_lazily(self._table.find(lease))
        self._counters["leases_granted"] += 1
        return lease

    def live(self, lease: Lease) -> HeldLease:
        """What ``lease`` holds; StoreError if it was released or has expired."""
        return self._table.live(lease)

    def find(self, lease: Lease) -> HeldLease | None:
        """What ``lease`` holds, expired or not; None once it was released."""
        return self._table.find(lease)

    def holds(self, lease: Lease) -> bool:
        return lease in self._table

    def release(self, lease: Lease) -> None:
        """Let go of everything ``lease`` pins (harmless if already released); while a copy
        reads it, no further read succeeds and the pins go when the copy ends."""
        held = self._table.find(lease)
        if held is not None and held.readers:
            lease.released = True  # fail closed: no new read of it
            held.release_wanted = True
            self._counters["lease_releases_deferred"] += 1
            return
        held = self._table.pop(lease)
        if held is None:
            return
        self._dram.let_go(held)
        if any(held.ssd):
            for entry in held.ssd:
                if entry is not None:
                    self._backing.unpin(entry)
        self._guard.cond.notify_all()

    @contextmanager
    def reading(self, lease: Lease) -> Iterator[None]:
        """Inside, a copy reads ``lease``'s blocks: the lease does not expire and a release
        waits for the end (the blocks stay pinned, so no write reuses memory a copy in flight
        still reads). Reads past its deadline still fail (``live``). Takes the store's lock."""
        with self._guard.cond:
            held = self._table.find(lease)
            if held is not None:
                held.readers += 1
        try:
            yield
        finally:
            if held is not None:
                with self._guard.cond:
                    held.readers -= 1
                    if not held.readers and self._table.find(lease) is held:
                        if held.lease.expired(time.monotonic()) and not held.release_wanted:
                            self._counters["leases_expired"] += 1
                            self._counters["leases_expired_after_reading"] += 1
                            held.release_wanted = True
                        if held.release_wanted:
                            self.release(lease)

    def expire(self, now: float) -> int:
        """Release every lease past its deadline that no copy reads; returns how many."""
        expired = self._table.expired(now)
        for lease in expired:
            self.release(lease)
        self._counters["leases_expired"] += len(expired)
        return len(expired)

    def __iter__(self) -> Iterator[HeldLease]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)
