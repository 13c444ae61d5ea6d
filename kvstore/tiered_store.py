"""The daemon's block store: a pinned DRAM pool in front of an optional SSD tier.

Every block lives in DRAM (``_blocks``), on SSD, or both. Writes land in DRAM; when DRAM use passes
the high watermark a background thread writes the least recently used unpinned blocks to SSD and
frees their DRAM once the SSD copy is durable, down to the low watermark. A block being demoted
stays readable. Without an SSD tier there is no thread: eviction costs no IO, so room is made on
demand and all of DRAM stays useful. Reading an SSD block through a lease promotes it into DRAM;
``done`` lets go of a lease's block once its reader has copied it, so a lease may cover more
SSD blocks than DRAM holds.

Lookups of long chains are the hot path: READY blocks are indexed a second time by namespace and
hash (``_ready``), idents are compared list against list, and a lease does not visit its DRAM
blocks. Their pin counts include the lease only once something is about to free, evict, demote
or replace a block (``_count_pins_locked``), and their LRU access is recorded when the lease lets
go of them: a pinned block cannot be a victim before then anyway.

Blocks that leave every tier (evicted without SSD, evicted or dropped as damaged on SSD, removed)
are reported to ``on_dropped`` in batches, outside the lock, by the thread that dropped them: the
cluster withdraws them from its index. A DRAM → SSD demotion is no drop.

Locking: one lock guards the index, pool, policy, leases and counters. SSD IO runs outside it on
blocks that are marked ``demoting`` (their DRAM bytes cannot be freed or reused meanwhile) or
freshly reserved (``IN_FLIGHT``, invisible). Lock order: this store's lock, then the SSD tier's.

This module is the facade (lookups, reads, removal, leases, stats, lifecycle); its parts are
mixins: ``dram_blocks`` (the DRAM index and lazy pin counting), ``tier_mover`` (demotion,
promotion, making room), ``store_writes`` (the write path), ``drop_reports`` (``on_dropped``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

from kvstore.block_store import (
    BlockStore,
    Lease,
    LookupResult,
    StoreError,
    Tier,
)
from kvstore.dram_blocks import (
    _ABSENT,
    _BAD_SIZES,
    DramIndex,
    _Block,
    _State,
    _verified_len,
)
from kvstore.drop_reports import DropReporter
from kvstore.eviction import make_policy
from kvstore.host_pool import HostPool
from kvstore.keys import HASH_BYTES, truncate_hash
from kvstore.leases import HeldLease, LeaseTable
from kvstore.ssd_files import OS_FILE_OPS, FileOps
from kvstore.ssd_tier import SSDEntry, SSDTier
from kvstore.store_config import StoreConfig
from kvstore.store_writes import StoreWrites
from kvstore.tier_mover import DEMOTE_BATCH_BYTES, TierMover  # noqa: F401 (re-exported)

__all__ = ["StoreConfig", "TieredStore"]

# Every outcome the store counts, present from the start so exported series never appear late.
# Per block: lookup_blocks == hit_blocks_dram + hit_blocks_ssd + miss_blocks; ``collisions``
# counts the lookups that stopped at an ident mismatch (their misses are in miss_blocks).
COUNTERS = (
    "lookups", "lookup_blocks", "hit_blocks_dram", "hit_blocks_ssd", "miss_blocks", "collisions",
    "leases_granted", "leases_expired", "puts", "put_bytes", "duplicate_puts",
    "put_collisions_dropped", "collisions_replaced", "put_too_large", "aborts", "evictions",
    "dram_releases", "demotions", "demotion_failures", "promotions", "promotion_failures",
    "removes",
)


class TieredStore(DramIndex, TierMover, StoreWrites, DropReporter, BlockStore):
    """DRAM + optional SSD block store with verified hits, leases and background demotion."""

    def __init__(self, config: StoreConfig, ssd_file_ops: FileOps = OS_FILE_OPS) -> None:
        """``ssd_file_ops``: the SSD data files' IO calls (the default is ``os``; tests pass
        one that injects faults)."""
        self.config = config
        self._pool = HostPool(config.dram_bytes, config.alignment, config.pin_memory)
        self._ssd: SSDTier | None = None
        if config.ssd_enabled:
            try:
                self._ssd = SSDTier(config.ssd_dir, config.ssd_bytes, config.eviction,
                                    config.ssd_io_mode, config.ssd_max_file_bytes,
                                    file_ops=ssd_file_ops)
            except BaseException:
                self._pool.close()
                raise
        # Told (namespace, block hashes) of blocks no tier holds any more; see _report_dropped.
        self.on_dropped: Callable[[bytes, list[bytes]], None] | None = None
        self._dropped: deque[bytes] = deque()  # keys that may have left every tier
        if self._ssd is not None:
            self._ssd.on_drop = self._note_drop
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._blocks: dict[bytes, _Block] = {}
        # The READY blocks of _blocks again, by namespace then (store) hash: a lookup finds them
        # without building a key per block.
        self._ready: dict[bytes, dict[bytes, _Block]] = {}
        self._private: set[_Block] = set()
        self._uncounted: dict[int, HeldLease] = {}  # by lease id; see _count_pins_locked
        self._promoting: dict[bytes, _Block] = {}
        self._policy = make_policy(config.eviction)
        self._leases = LeaseTable(self, config.lease_ttl_s)
        self._num_demoting = 0
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._closed = False
        self._high_bytes = int(self._pool.capacity_bytes * config.demote_high_watermark)
        self._low_bytes = int(self._pool.capacity_bytes * config.demote_low_watermark)
        self._thread: threading.Thread | None = None
        if self._ssd is not None:
            self._thread = threading.Thread(target=self._demote_loop, name="kvstore-demote",
                                            daemon=True)
            self._thread.start()

    # -- lookups -------------------------------------------------------------------------------

    def lookup(self, namespace: bytes, block_hashes: Sequence[bytes], idents: Sequence[bytes],
               lease_ttl_s: float | None = 30.0, owner: str = "") -> LookupResult:
        num_blocks = len(block_hashes)
        if num_blocks != len(idents):
            raise StoreError("block_hashes and idents differ in length")
        if len(namespace) != HASH_BYTES:
            raise StoreError(_BAD_SIZES)
        namespace = bytes(namespace)
        hashes = self._index_hashes(block_hashes)
        if type(idents) is not list:
            idents = list(idents)
        want_lease = lease_ttl_s is not None
        with self._lock:
            self._check_open()
            found, hashes = self._find_ready_locked(namespace, hashes)
            # The common case stays in C: every block is in DRAM and every ident matches.
            stored_idents = [block.ident for block in found]
            if stored_idents == idents:
                num_dram = num_blocks
            else:
                num_dram = _verified_len(found, stored_idents, idents)
                # A hash found in DRAM has the right size; the rest must be checked, before
                # anything is counted or pinned.
                if not {HASH_BYTES}.issuperset(map(len, block_hashes[num_dram:])):
                    raise StoreError(_BAD_SIZES)
            dram: list[_Block | None] = found if num_dram == num_blocks else found[:num_dram]
            ssd: list[SSDEntry | None] = [None] * num_dram
            collided = num_dram < len(found) and found[num_dram] is not _ABSENT
            if num_dram < num_blocks and not collided and self._ssd is not None:
                collided = self._extend_from_ssd_locked(namespace, hashes, idents, found, dram,
                                                        ssd)
            entries = [e for e in ssd if e is not None] if len(dram) > num_dram else []
            if want_lease and entries:
                # Entries the SSD dropped since lookup_prefix (another thread's write evicted
                # them) cannot be pinned: the hit ends before the first of them.
                num_pinned = self._ssd.pin_many(entries)
                if num_pinned < len(entries):
                    cut = ssd.index(entries[num_pinned])
                    del dram[cut:], ssd[cut:], entries[num_pinned:]
            num_hit, num_ssd = len(dram), len(entries)
            if entries:
                self._ssd.touch_many(entries)
                tiers = [Tier.SSD if b is None else Tier.DRAM for b in dram]
            else:
                tiers = [Tier.DRAM] * num_hit
            c = self._counters
            c["lookups"] += 1
            c["lookup_blocks"] += num_blocks
            c["miss_blocks"] += num_blocks - num_hit
            c["collisions"] += collided
            c["hit_blocks_dram"] += num_hit - num_ssd
            c["hit_blocks_ssd"] += num_ssd
            if not want_lease or num_hit == 0:
                touch = self._policy.touch
                for block in dram:
                    if block is not None:
                        touch(block.key)
                return LookupResult(num_hit, tiers, None)
            # The lease's DRAM blocks are pinned by the lease itself, counted into their ``pins``
            # only when something asks (_count_pins_locked); their access is recorded when the
            # lease lets go of them. A lookup whose lease ends before DRAM runs short of room
            # never touches its blocks one by one.
            lease = self._leases.grant(namespace, block_hashes[:num_hit], tiers, dram, ssd,
                                       lease_ttl_s, owner)
            if num_hit > num_ssd:
                held = self._leases.find(lease)
                held.counted = False
                self._uncounted[lease.lease_id] = held
            c["leases_granted"] += 1
            return LookupResult(num_hit, tiers, lease)

    def _extend_from_ssd_locked(self, namespace: bytes, hashes: list[bytes], idents: list,
                                found: list, dram: list, ssd: list) -> bool:
        """Continue a hit past its DRAM prefix: each further block from DRAM if READY there,
        else from SSD, up to the first block neither holds. True if it stopped at a collision.
        """
        start = len(dram)
        # SSD entries of the keys DRAM lacks, in order. lookup_prefix iterates the keys once and
        # stops at the first it lacks, so they are made as it goes (a miss makes one).
        below = iter(self._ssd.lookup_prefix(
            namespace + hashes[i] for i in range(start, len(found)) if found[i] is _ABSENT))
        for i in range(start, len(found)):
            block = found[i]
            if block is not _ABSENT:
                if block.ident != idents[i]:
                    return True
                dram.append(block)
                ssd.append(None)
                continue
            entry = next(below, None)
            if entry is None:
                return False
            if entry.ident != idents[i]:
                return True
            dram.append(None)
            ssd.append(entry)
        return False

    def read(self, lease: Lease, index: int) -> memoryview:
        try:
            return self._read(lease, index)
        finally:
            if self._dropped:  # a promotion made room, or found its SSD copy damaged
                self._report_dropped()

    def _read(self, lease: Lease, index: int) -> memoryview:
        with self._lock:
            held = self._leases.live(lease)
            if not 0 <= index < len(held.dram):
                raise StoreError(f"lease {lease.lease_id} has no block {index}")
            if held.dram[index] is not None:
                return self._view(held.dram[index])
            if held.ssd[index] is None:
                raise StoreError(f"block {index} of lease {lease.lease_id} was already done")
            self._count_lease_pins_locked(held)  # the promoted block is pinned one by one
            return self._promote_locked(held, index)

    def done(self, lease: Lease, index: int) -> None:
        with self._lock:
            held = self._leases.find(lease)
            if held is None:
                return  # released or expired: nothing of it is pinned any more
            if not 0 <= index < len(held.dram):
                raise StoreError(f"lease {lease.lease_id} has no block {index}")
            self._count_lease_pins_locked(held)
            block, entry = held.dram[index], held.ssd[index]
            held.dram[index] = held.ssd[index] = None
            if block is not None:
                self._unpin_block_locked(block)
            if entry is not None:
                self._ssd.unpin(entry)

    # -- removal and leases --------------------------------------------------------------------

    def remove(self, namespace: bytes, block_hash: bytes) -> bool:
        key = self._key(namespace, block_hash)
        with self._lock:
            self._check_open()
            self._count_pins_locked()
            block = self._blocks.get(key)
            if block is not None and (block.pins or block.demoting
                                      or block.state is not _State.READY):
                return False
            entry = self._ssd.lookup(key) if self._ssd is not None else None
            if entry is not None and entry.pins:
                return False
            if block is not None:
                self._drop_block_locked(block)
                self._note_drop(key)
        # The SSD drop commits to LMDB (an fsync): done off the store lock. A lease taken on
        # the SSD copy in between wins (the entry stays).
        removed = block is not None
        if entry is not None:
            removed = self._ssd.remove(entry) or removed
        if removed:
            with self._lock:
                self._counters["removes"] += 1
        if self._dropped:
            self._report_dropped()
        return removed

    def release(self, lease: Lease) -> None:
        with self._lock:
            self._release_locked(lease)

    def expire_leases(self, now: float | None = None) -> int:
        with self._lock:
            return self._expire_leases_locked(time.monotonic() if now is None else now)

    def _expire_leases_locked(self, now: float) -> int:
        expired = self._leases.expired(now)
        for lease in expired:
            self._release_locked(lease)
        self._counters["leases_expired"] += len(expired)
        return len(expired)

    # -- reporting and lifecycle ---------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            self._count_pins_locked()  # for pinned_blocks
            c = dict(self._counters)
            blocks = self._blocks.values()
            dram = {
                "capacity_bytes": self._pool.capacity_bytes,
                "used_bytes": self._pool.used_bytes,
                "blocks": sum(1 for b in blocks if b.state is _State.READY),
                "in_flight_blocks": sum(1 for b in blocks if b.state is _State.IN_FLIGHT),
                "pinned_blocks": sum(1 for b in blocks if b.pins) + len(self._private),
                "demoting_blocks": self._num_demoting,
                "pinned": self._pool.pinned,  # page-locked host memory
                "pin_error": self._pool.pin_error,  # why not, where pinning was tried
                "hits": c.get("hit_blocks_dram", 0),
            }
            if self._ssd is not None:
                ssd = self._ssd.stats()
                ssd["enabled"] = True
            else:
                ssd = {"enabled": False, "capacity_bytes": 0, "used_bytes": 0, "blocks": 0}
            ssd["hits"] = c.get("hit_blocks_ssd", 0)
            return {"tiers": {"dram": dram, "ssd": ssd}, "counters": c,
                    "leases": len(self._leases)}

    def check_integrity(self) -> None:
        with self._lock:
            self._pool.check_integrity()
            assert all(not h.counted and self._leases.find(h.lease) is h
                       for h in self._uncounted.values()), "uncounted leases"
            self._count_pins_locked()
            live = list(self._blocks.values()) + list(self._private)
            assert sorted((b.alloc.offset, b.alloc.reserved_bytes) for b in live) == \
                self._pool.allocations(), "DRAM allocations differ from the blocks that own them"
            ready = {k: b for k, b in self._blocks.items() if b.state is _State.READY}
            assert set(self._policy.victims()) == set(ready), "policy tracks other keys than READY"
            assert {ns + h: b for ns, blocks in self._ready.items() for h, b in blocks.items()} \
                == ready and all(self._ready.values()), "READY index differs from the blocks"
            assert all(b.key == k and b.indexed for k, b in self._blocks.items())
            pins: Counter[int] = Counter()
            for held in self._leases:
                assert not held.lease.released, "a released lease is still held"
                assert len(held.lease.block_hashes) == len(held.dram) == len(held.ssd)
                for block in held.dram:  # a slot pinning nothing is one the reader is done with
                    if block is not None:
                        pins[id(block)] += 1
            for block in self._promoting.values():
                pins[id(block)] += 1
            for block in live:
                assert block.pins == pins[id(block)], f"block {block.key.hex()} pin count"
            assert self._num_demoting == sum(b.demoting for b in live), "demoting count"
            if self._ssd is not None:
                self._ssd.check_integrity()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            while self._num_demoting or self._promoting:
                self._cond.wait(0.1)
        if self._thread is not None:
            self._thread.join()
        if self._ssd is not None:
            self._ssd.close()
        self._pool.close()

    @property
    def ssd_tier(self) -> SSDTier | None:
        """The SSD tier, for stats and tools (``locate``); None when SSD is off."""
        return self._ssd

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------------

    def _key(self, namespace: bytes, block_hash: bytes) -> bytes:
        """The index key: namespace || hash (truncated in debug mode). StoreError on bad sizes."""
        if len(namespace) != HASH_BYTES or len(block_hash) != HASH_BYTES:
            raise StoreError(_BAD_SIZES)
        return bytes(namespace) + self._index_hashes([block_hash])[0]

    def _index_hashes(self, block_hashes: Sequence[bytes]) -> Sequence[bytes]:
        """The hashes the index is keyed by: as given, or truncated in debug mode.

        In debug mode every size is checked here (a truncated hash no longer shows it);
        otherwise ``lookup`` checks the sizes of the hashes DRAM did not find.
        """
        bits = self.config.debug_hash_bits
        if bits is None:
            return block_hashes
        if not {HASH_BYTES}.issuperset(map(len, block_hashes)):
            raise StoreError(_BAD_SIZES)
        return [truncate_hash(bytes(h), bits) for h in block_hashes]

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

