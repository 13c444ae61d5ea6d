"""The tier contract: what the tiered store's parts call on a tier, whichever tier it is.

A tier holds blocks under index keys (namespace || hash, ``index_keys.py``); each entry carries
the ident that proves a hit, which the caller compares. The store's tiers stand in one order,
fastest first: DRAM (``dram/tier.py``), where every block is written and read, then one backing
tier behind it (``ssd/tier.py``; ``null_tier.py`` when there is none). A lookup walks them in
that order; a block may live in several at once (demoted to SSD and still in DRAM).

Every tier (``StoreTier``):

- ``tier``: its name, the key of its stats under ``tiers`` and of its hit counter.
- ``lookup(key)``: the entry held under ``key``, or None; not pinned, no IO. DRAM's includes a
  block being written (IN_FLIGHT), so a caller checks the entry's state where it matters.
- ``key in tier``: whether ``lookup(key)`` finds an entry.
- ``pin_many(entries)``: pins entries it returned, in order, up to the first one dropped
  meanwhile; returns how many it pinned. A pinned entry is never evicted, demoted or removed.
- ``unpin(entry)``: lets go of one pin that ``pin_many`` took.
- ``touch_many(entries)``: records an access of each live entry (the eviction order); a None
  among them (a block another tier holds) is skipped.
- ``stats()``: ``capacity_bytes``, ``used_bytes`` and ``blocks``, with whatever else the tier
  counts; these are ``/stats`` keys (the store adds ``hits``).
- ``check_integrity()``: AssertionError when the tier's own accounting is off.
- ``close()``: lets go of memory, files and locks; closing twice is harmless.

A backing tier (``BackingTier``) also takes blocks from DRAM and gives them back:

- ``enabled``: False only for a tier switched off, which holds nothing and takes nothing; the
  store then evicts what DRAM cannot keep instead of demoting it, and runs no demotion thread.
- ``lookup_prefix(keys)``: the entries of ``keys`` in order, up to the first key not held.
- ``contains(key, ident)``: whether it holds a block under ``key`` with that ident.
- ``write_many(items)``: makes each block durable (evicting its own oldest unpinned entries for
  room); per item, whether it is stored now. Called without the store's lock.
- ``read_into(entry, dest)``: fills ``dest`` with the entry's verified bytes; False when they
  were damaged (the entry is then dropped, and the tier's drop listener told).
- ``remove(entry)``: drops an unpinned entry; False if it is pinned or already gone.

Locking: DRAM has no lock of its own (every call runs under the store's lock); a backing tier
takes its own, after the store's when both are held. The contract tests
(``tests/kvstore/store/test_tier_contract.py``) run against every tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Generic, NamedTuple, TypeVar

from kvstore.tiers import Tier

Entry = TypeVar("Entry")


class BlockWrite(NamedTuple):
    """One block for a backing tier: ``data`` holds its ``num_bytes``, maybe then padding."""

    key: bytes
    ident: bytes
    data: memoryview
    num_bytes: int


class StoreTier(ABC, Generic[Entry]):
    """One tier of the tiered store (the contract is the module's docstring)."""

    tier: Tier

    @abstractmethod
    def lookup(self, key: bytes) -> Entry | None: ...

    @abstractmethod
    def __contains__(self, key: bytes) -> bool: ...

    @abstractmethod
    def keys(self) -> list[bytes]:
        """Every key the tier holds or is writing, as of the call (a copy)."""

    @abstractmethod
    def pin_many(self, entries: Sequence[Entry]) -> int: ...

    @abstractmethod
    def unpin(self, entry: Entry) -> None: ...

    @abstractmethod
    def touch_many(self, entries: Iterable[Entry | None]) -> None: ...

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class BackingTier(StoreTier[Entry]):
    """A tier behind DRAM: the demoter writes into it, the promoter reads from it."""

    @property
    @abstractmethod
    def enabled(self) -> bool: ...

    @abstractmethod
    def lookup_prefix(self, keys: Iterable[bytes]) -> list[Entry]: ...

    @abstractmethod
    def contains(self, key: bytes, ident: bytes) -> bool: ...

    @abstractmethod
    def write_many(self, items: Sequence[BlockWrite]) -> list[bool]: ...

    @abstractmethod
    def read_into(self, entry: Entry, dest: memoryview) -> bool: ...

    @abstractmethod
    def remove(self, entry: Entry) -> bool: ...
