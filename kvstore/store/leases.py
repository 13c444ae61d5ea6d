"""The store's live leases: what each pins, found by id, listed by deadline. Plain state.

Not thread-safe: the tiered store calls it under its lock, and does the pinning and unpinning
itself; this table only remembers which blocks each lease holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.store.block_store import BlockStore, Lease, StoreError, Tier


@dataclass(eq=False, slots=True)
class HeldLease:
    """A live lease and, per block, the DRAM block and/or the SSD entry it pins (or None).

    A read of an SSD block fills its ``dram`` slot after promotion; ``done`` empties both slots
    of a block (a slot pinning nothing is one the reader has let go of). ``counted``: whether
    the ``dram`` blocks' pin counts include this lease yet (the store counts them lazily).
    ``readers``: copies reading the lease's blocks now (``LeasePins.reading``); while there
    are any it neither expires nor lets go of a block, and a release asked for meanwhile
    (``release_wanted``) happens when the last one ends.
    """

    lease: Lease
    dram: list  # list[Block | None] (store/dram/blocks.py)
    ssd: list  # list[SSDEntry | None]
    counted: bool = True
    readers: int = 0
    release_wanted: bool = False


class LeaseTable:
    """Leases granted by ``store``, each for at most ``max_ttl_s`` seconds."""

    def __init__(self, store: BlockStore, max_ttl_s: float) -> None:
        self._store = store
        self._max_ttl_s = max_ttl_s
        self._held: dict[int, HeldLease] = {}
        self._next_id = 1

    def grant(self, namespace: bytes, block_hashes: Sequence[bytes], tiers: list[Tier],
              dram: list, ssd: list, ttl_s: float, owner: str) -> Lease:
        """A new lease over the given (already pinned) blocks; the TTL is capped."""
        ttl = min(max(float(ttl_s), 0.0), self._max_ttl_s)
        lease = Lease(self._next_id, namespace, list(block_hashes), tiers,
                      time.monotonic() + ttl, owner, store=self._store)
        self._next_id += 1
        self._held[lease.lease_id] = HeldLease(lease, dram, ssd)
        return lease

    def live(self, lease: Lease) -> HeldLease:
        """What ``lease`` holds; StoreError if it was released or has expired."""
        held = self._held.get(lease.lease_id)
        if held is None or held.lease is not lease or lease.released:
            raise StoreError(f"lease {lease.lease_id} was released")
        if lease.expired():
            raise StoreError(f"lease {lease.lease_id} expired")
        return held

    def find(self, lease: Lease) -> HeldLease | None:
        """What ``lease`` holds, expired or not; None once it was released."""
        held = self._held.get(lease.lease_id)
        return held if held is not None and held.lease is lease else None

    def pop(self, lease: Lease) -> HeldLease | None:
        """Forget ``lease`` (marking it released); what it held, or None if already gone."""
        lease.released = True
        held = self._held.get(lease.lease_id)
        if held is None or held.lease is not lease:
            return None
        del self._held[lease.lease_id]
        return held

    def expired(self, now: float) -> list[Lease]:
        """The leases past their deadline that no copy reads now."""
        return [h.lease for h in self._held.values() if h.lease.expired(now) and not h.readers]

    def __contains__(self, lease: Lease) -> bool:
        held = self._held.get(lease.lease_id)
        return held is not None and held.lease is lease

    def __iter__(self) -> Iterator[HeldLease]:
        return iter(self._held.values())

    def __len__(self) -> int:
        return len(self._held)
