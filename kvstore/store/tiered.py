"""The daemon's block store: a pinned DRAM pool in front of a backing tier (SSD, or none).

The tiers keep one contract (``store_tier.py``) and stand in one order, DRAM first; without an
SSD the backing tier is the null tier (``null_tier.py``), which holds nothing. Every block lives
in DRAM, on SSD, or both. Writes land in DRAM (``write_path.py``); the demoter (``demoter.py``)
moves least recently used unpinned blocks to SSD, or evicts them without one; lookups, reads and
``done`` are the read path (``read_path.py``), which promotes leased SSD blocks into DRAM
(``promoter.py``). The parts share one ``StoreParts`` (``parts.py``). This module ties them
together and keeps removal, leases, stats and the lifecycle.

Blocks that leave every tier (evicted without SSD, evicted or dropped as damaged on SSD, removed)
are reported to the drop listeners (``add_drop_listener``) in batches, outside the lock, by the
thread that dropped them: the cluster withdraws them from its index. A DRAM → SSD demotion is no
drop.

Locking: one lock (``StoreGuard``) guards the DRAM tier, leases and counters. SSD IO runs outside
it on blocks marked ``demoting`` or freshly reserved (IN_FLIGHT, invisible). Lock order: this
store's lock, then the SSD tier's.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager

from kvstore.keys import HASH_BYTES
from kvstore.store.block_store import (
    BlockStore,
    DropListener,
    Lease,
    LookupResult,
    Tier,
    WriteSlot,
)
from kvstore.store.config import StoreConfig
from kvstore.store.demoter import DEMOTE_BATCH_BYTES, Demoter
from kvstore.store.dram.blocks import BlockState
from kvstore.store.dram.pool import HostPool
from kvstore.store.dram.tier import DramTier
from kvstore.store.drop_reports import DropReports
from kvstore.store.eviction import make_policy
from kvstore.store.guard import StoreGuard
from kvstore.store.index_keys import IndexKeys
from kvstore.store.lease_pins import LeasePins
from kvstore.store.leases import LeaseTable
from kvstore.store.null_tier import NullTier
from kvstore.store.parts import StoreParts
from kvstore.store.promoter import Promoter
from kvstore.store.read_path import ReadPath
from kvstore.store.ssd.files import OS_FILE_OPS, FileOps
from kvstore.store.ssd.tier import SSDTier
from kvstore.store.store_tier import BackingTier
from kvstore.store.write_path import WritePath

__all__ = ["DEMOTE_BATCH_BYTES", "StoreConfig", "TieredStore"]

# Every outcome the store counts, present from the start so exported series never appear late.
# Per block: lookup_blocks == hit_blocks_dram + hit_blocks_ssd + miss_blocks; ``collisions``
# counts the lookups that stopped at an ident mismatch (their misses are in miss_blocks).
COUNTERS = (
    "lookups", "lookup_blocks", "hit_blocks_dram", "hit_blocks_ssd", "miss_blocks", "collisions",
    "leases_granted", "leases_expired", "puts", "put_bytes", "duplicate_puts",
    "put_collisions_dropped", "collisions_replaced", "put_too_large", "aborts", "evictions",
    "dram_releases", "demotions", "demotion_failures", "promotions", "promotion_failures",
    "removes", "puts_replaced", "put_busy",
)


def _backing_tier(config: StoreConfig, file_ops: FileOps,
                  on_drop: Callable[[bytes], None]) -> BackingTier:
    """The tier behind DRAM that ``config`` asks for: the SSD tier, or the null tier."""
    if not config.ssd_enabled:
        return NullTier()
    return SSDTier(config.ssd_dir, config.ssd_bytes, config.eviction, config.ssd_io_mode,
                   config.ssd_max_file_bytes, file_ops=file_ops, on_drop=on_drop)


class TieredStore(BlockStore):
    """DRAM + optional SSD block store with verified hits, leases and background demotion."""

    def __init__(self, config: StoreConfig, ssd_file_ops: FileOps = OS_FILE_OPS) -> None:
        """``ssd_file_ops``: the SSD data files' IO calls (the default is ``os``; tests pass
        one that injects faults)."""
        self.config = config
        drops = DropReports(self._still_gone)
        pool = HostPool(config.dram_bytes, config.alignment, config.pin_memory)
        try:
            backing = _backing_tier(config, ssd_file_ops, drops.note)
        except BaseException:
            pool.close()
            raise
        dram = DramTier(pool, make_policy(config.eviction))
        parts = StoreParts(StoreGuard(), dram, backing,
                           Counter(dict.fromkeys(COUNTERS, 0)), drops)
        self._guard, self._counters, self._drops = parts.guard, parts.counters, drops
        self._lock = self._guard.lock  # tests check that listeners are told without it
        self._dram, self._backing = dram, backing
        self._tiers = parts.tiers
        self._keys = keys = IndexKeys(config.debug_hash_bits)
        self._leases = LeasePins(parts, LeaseTable(self, config.lease_ttl_s))
        self._demoter = Demoter(parts, self._leases, config.demote_high_watermark,
                                config.demote_low_watermark)
        self._promoter = Promoter(parts, self._leases, self._demoter)
        self._reads = ReadPath(parts, keys, self._leases, self._promoter)
        self._writes = WritePath(parts, keys, self._demoter)

    # -- the BlockStore verbs ------------------------------------------------------------------

    def lookup(self, namespace: bytes, block_hashes: Sequence[bytes], idents: Sequence[bytes],
               lease_ttl_s: float | None = 30.0, owner: str = "") -> LookupResult:
        return self._reads.lookup(namespace, block_hashes, idents, lease_ttl_s, owner)

    def probe(self, namespace: bytes, block_hashes: Sequence[bytes],
              idents: Sequence[bytes]) -> list[Tier]:
        return self._reads.probe(namespace, block_hashes, idents)

    def read(self, lease: Lease, index: int) -> memoryview:
        return self._reads.read(lease, index)

    def read_addresses(self, lease: Lease, start: int, count: int, num_bytes: int) -> list[int]:
        return self._reads.read_addresses(lease, start, count, num_bytes)

    def done(self, lease: Lease, index: int) -> None:
        self._reads.done(lease, index)

    def done_range(self, lease: Lease, start: int, count: int) -> None:
        self._reads.done_range(lease, start, count)

    def begin_write(self, namespace: bytes, block_hash: bytes, ident: bytes,
                    num_bytes: int) -> WriteSlot | None:
        return self._writes.begin_write(namespace, block_hash, ident, num_bytes)

    def replace(self, namespace: bytes, block_hash: bytes, ident: bytes,
                data: bytes | memoryview, wait_s: float = 5.0) -> bool:
        try:
            return self._writes.replace(namespace, block_hash, ident, memoryview(data).cast("B"),
                                        wait_s)
        finally:
            if self._drops.pending:  # room was made by evicting blocks
                self._drops.report()

    def holding(self, namespace: bytes, block_hashes: Sequence[bytes]) -> list[bool]:
        keys = [self._keys.key(namespace, h) for h in block_hashes]
        held = set(self._still_held(keys))
        return [k in held for k in keys]

    def held_hashes(self) -> list[bytes]:
        with self._guard.cond:
            keys = self._dram.keys()
        keys += self._backing.keys()  # under the SSD tier's own lock
        return [key[HASH_BYTES:] for key in keys]

    def remove(self, namespace: bytes, block_hash: bytes) -> bool:
        key = self._keys.key(namespace, block_hash)
        with self._guard.cond:
            self._guard.check_open()
            block = self._dram.lookup(key)
            if block is not None and (self._dram.is_pinned(block) or block.demoting
                                      or block.state is not BlockState.READY):
                return False
            entry = self._backing.lookup(key)
            if entry is not None and entry.pins:
                return False
            if block is not None:
                self._dram.drop(block)
                self._drops.note(key)
        # The SSD drop commits to LMDB (an fsync): done off the store lock. A lease taken on
        # the SSD copy in between wins (the entry stays).
        removed = block is not None
        if entry is not None:
            removed = self._backing.remove(entry) or removed
        if removed:
            with self._guard.cond:
                self._counters["removes"] += 1
        if self._drops.pending:
            self._drops.report()
        return removed

    def release(self, lease: Lease) -> None:
        with self._guard.cond:
            self._leases.release(lease)

    def reading(self, lease: Lease) -> AbstractContextManager[None]:
        return self._leases.reading(lease)

    def expire_leases(self, now: float | None = None) -> int:
        with self._guard.cond:
            return self._leases.expire(time.monotonic() if now is None else now)

    def flush_to_ssd(self) -> int:
        """See ``BlockStore``; only the blocks that fit on SSD are kept there."""
        with self._guard.cond:
            num_written = self._demoter.flush_locked()
        if self._drops.pending:  # the SSD evicted older blocks to take these
            self._drops.report()
        return num_written

    def add_drop_listener(self, listener: DropListener) -> None:
        self._drops.listeners.add(listener)

    def remove_drop_listener(self, listener: DropListener) -> None:
        self._drops.listeners.remove(listener)

    # -- reporting and lifecycle ---------------------------------------------------------------

    def host_spans(self) -> list[tuple[int, int]]:
        return self._dram.pool.spans()

    def stats(self) -> dict:
        with self._guard.cond:
            c = dict(self._counters)
            tiers = {tier.tier.value: tier.stats() for tier in self._tiers}
            pool = self._dram.pool
            tiers[self._dram.tier.value].update({
                "demoting_blocks": self._demoter.num_demoting,
                "promoting_blocks": len(self._promoter.blocks()),
                "pinned": pool.pinned,  # page-locked host memory
                "pin_error": pool.pin_error,  # why not, where pinning was tried
            })
            for name, stats in tiers.items():
                stats["hits"] = c.get(f"hit_blocks_{name}", 0)
            return {"tiers": tiers, "counters": c, "leases": len(self._leases)}

    def check_integrity(self) -> None:
        with self._guard.cond:
            held_leases = list(self._leases)
            for held in held_leases:
                assert not held.lease.released, "a released lease is still held"
                assert len(held.lease.block_hashes) == len(held.dram) == len(held.ssd)
            for tier in self._tiers:
                tier.check_integrity()
            self._dram.check_pins(held_leases, self._promoter.blocks(),
                                  self._demoter.num_demoting)

    def close(self) -> None:
        with self._guard.cond:
            if self._guard.closed:
                return
            self._guard.closed = True
            self._guard.cond.notify_all()
            while self._demoter.num_demoting or self._promoter.busy:
                self._guard.cond.wait(0.1)
        self._demoter.join()
        for tier in reversed(self._tiers):  # the slowest first: SSD files, then the pool
            tier.close()

    @property
    def ssd_tier(self) -> BackingTier:
        """The tier behind DRAM, for tools and tests (``SSDTier.locate``): the null tier
        when SSD is off."""
        return self._backing

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _still_gone(self, keys: set[bytes]) -> list[bytes]:
        """The keys of ``keys`` no tier holds now (takes the store's lock)."""
        held = set(self._still_held(keys))
        return [k for k in keys if k not in held]

    def _still_held(self, keys: Iterable[bytes]) -> list[bytes]:
        """The keys of ``keys`` a tier holds now, being written included (takes the lock)."""
        tiers = self._tiers
        with self._guard.cond:
            return [k for k in keys if any(k in tier for tier in tiers)]
