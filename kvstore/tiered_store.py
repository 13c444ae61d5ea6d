"""The daemon's block store: a pinned DRAM pool in front of an optional SSD tier.

Every block lives in DRAM (``_blocks``), on SSD, or both. Writes land in DRAM; when DRAM use passes
the high watermark a background thread writes the least recently used unpinned blocks to SSD and
frees their DRAM once the SSD copy is durable, down to the low watermark. A block being demoted
stays readable. Without an SSD tier there is no thread: eviction costs no IO, so room is made on
demand and all of DRAM stays useful. Reading an SSD block through a lease promotes it into DRAM.

Locking: one lock guards the index, pool, policy, leases and counters. SSD IO runs outside it on
blocks that are marked ``demoting`` (their DRAM bytes cannot be freed or reused meanwhile) or
freshly reserved (``IN_FLIGHT``, invisible). Lock order: this store's lock, then the SSD tier's.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.allocator import Allocation
from kvstore.block_store import (
    BlockStore,
    BlockUnavailable,
    Lease,
    LookupResult,
    StoreError,
    Tier,
    WriteSlot,
)
from kvstore.eviction import make_policy
from kvstore.host_pool import HostPool
from kvstore.keys import HASH_BYTES, truncate_hash
from kvstore.leases import HeldLease, LeaseTable
from kvstore.ssd_tier import SSDEntry, SSDTier, SSDWrite
from kvstore.store_config import StoreConfig

__all__ = ["StoreConfig", "TieredStore"]

log = logging.getLogger(__name__)

DEMOTE_BATCH_BYTES = 64 << 20
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
_IDLE_WAKE_S = 1.0  # the demotion thread rechecks pressure at least this often


class _State(enum.Enum):
    IN_FLIGHT = "in_flight"  # reserved by a writer or being promoted: invisible, never evicted
    READY = "ready"


@dataclass(eq=False)
class _Block:
    key: bytes
    ident: bytes
    alloc: Allocation
    state: _State
    pins: int = 0  # leases holding it, plus one while a promotion fills it
    demoting: bool = False  # its bytes are being written to SSD: not freed meanwhile
    indexed: bool = True  # False: a lease's private copy (its key was taken meanwhile)


class _Slot(WriteSlot):
    def __init__(self, store: TieredStore, block: _Block, buffer: memoryview) -> None:
        self._store, self._block, self.buffer = store, block, buffer

    def commit(self) -> bool:
        published = self._store._commit(self._block)
        self._retire()
        return published

    def abort(self) -> None:
        self._store._abort(self._block)
        self._retire()

    def _retire(self) -> None:
        # Later writes through the slot then raise; if the caller still exports the buffer (a
        # NumPy array), the contract alone forbids them.
        with contextlib.suppress(BufferError):
            self.buffer.release()


class TieredStore(BlockStore):
    """DRAM + optional SSD block store with verified hits, leases and background demotion."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._pool = HostPool(config.dram_bytes, config.alignment, config.pin_memory)
        self._ssd: SSDTier | None = None
        if config.ssd_enabled:
            try:
                self._ssd = SSDTier(config.ssd_dir, config.ssd_bytes, config.eviction,
                                    config.ssd_io_mode, config.ssd_max_file_bytes)
            except BaseException:
                self._pool.close()
                raise
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._blocks: dict[bytes, _Block] = {}
        self._private: set[_Block] = set()
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
        if len(block_hashes) != len(idents):
            raise StoreError("block_hashes and idents differ in length")
        keys = self._keys(namespace, block_hashes)
        want_lease = lease_ttl_s is not None
        ready = _State.READY
        with self._lock:
            self._check_open()
            ssd_tier = self._ssd
            found = list(map(self._blocks.get, keys))
            below = iter(())  # SSD entries of the keys DRAM lacks, in order, up to the first gap
            if ssd_tier is not None:
                below = iter(ssd_tier.lookup_prefix(
                    [k for k, b in zip(keys, found) if b is None or b.state is not ready]))
            dram: list[_Block | None] = []
            ssd: list[SSDEntry | None] = []
            collided = False
            for ident, block in zip(idents, found):
                if block is not None and block.state is ready:
                    if block.ident != ident:
                        collided = True
                        break
                    dram.append(block)
                    ssd.append(None)
                    continue
                entry = next(below, None)
                if entry is None:
                    break
                if entry.ident != ident:
                    collided = True
                    break
                dram.append(None)
                ssd.append(entry)
            if want_lease and ssd_tier is not None:
                # Entries the SSD dropped since lookup_prefix (another thread's write evicted
                # them) cannot be pinned: the hit ends before the first of them.
                entries = [e for e in ssd if e is not None]
                num_pinned = ssd_tier.pin_many(entries)
                if num_pinned < len(entries):
                    cut = ssd.index(entries[num_pinned])
                    del dram[cut:], ssd[cut:]
            num_hit = len(dram)
            tiers = [Tier.SSD if b is None else Tier.DRAM for b in dram]
            touch = self._policy.touch
            num_dram = 0
            for block in dram:
                if block is not None:
                    num_dram += 1
                    touch(block.key)
            if num_dram < num_hit:
                ssd_tier.touch_many([e for e in ssd if e is not None])
            c = self._counters
            c["lookups"] += 1
            c["lookup_blocks"] += len(keys)
            c["miss_blocks"] += len(keys) - num_hit
            c["collisions"] += collided
            c["hit_blocks_dram"] += num_dram
            c["hit_blocks_ssd"] += num_hit - num_dram
            if not want_lease or num_hit == 0:
                return LookupResult(num_hit, tiers, None)
            for block in dram:
                if block is not None:
                    block.pins += 1
            lease = self._leases.grant(namespace, block_hashes[:num_hit], tiers, keys[:num_hit],
                                       dram, ssd, lease_ttl_s, owner)
            c["leases_granted"] += 1
            return LookupResult(num_hit, tiers, lease)

    def read(self, lease: Lease, index: int) -> memoryview:
        with self._lock:
            held = self._leases.live(lease)
            if not 0 <= index < len(held.keys):
                raise StoreError(f"lease {lease.lease_id} has no block {index}")
            if held.dram[index] is not None:
                return self._view(held.dram[index])
            return self._promote_locked(held, index)

    def _promote_locked(self, held: HeldLease, index: int) -> memoryview:
        """Copy the lease's SSD block ``index`` into DRAM (once, however many readers ask)."""
        key, entry = held.keys[index], held.ssd[index]
        while True:
            cur = self._blocks.get(key)
            if cur is not None and cur.state is _State.READY and cur.ident == entry.ident:
                cur.pins += 1  # someone promoted or re-put it meanwhile
                held.dram[index] = cur
                self._policy.touch(key)
                return self._view(cur)
            if key in self._promoting:
                self._cond.wait()
                held = self._leases.live(held.lease)
                continue
            try:
                alloc = self._allocate_locked(entry.num_bytes)  # may drop the lock
            except StoreError as exc:
                self._counters["promotion_failures"] += 1
                raise BlockUnavailable(f"no DRAM to promote into: {exc}") from None
            try:
                held = self._leases.live(held.lease)
            except StoreError:
                self._pool.free(alloc)
                raise
            cur = self._blocks.get(key)
            if key in self._promoting or (cur is not None and cur.state is _State.READY
                                          and cur.ident == entry.ident):
                self._pool.free(alloc)  # promoted or re-put while we made room: use that
                continue
            break
        block = _Block(key, entry.ident, alloc, _State.IN_FLIGHT, pins=1)
        self._promoting[key] = block
        self._lock.release()
        try:
            ok = self._ssd.read_into(entry, self._pool.view(alloc, padded=True))
        except BaseException:
            ok = False
            raise
        finally:
            self._lock.acquire()
            del self._promoting[key]
            self._cond.notify_all()
            if not ok:
                self._pool.free(alloc)
                self._counters["promotion_failures"] += 1
        if not ok:
            raise BlockUnavailable(f"block {index} of lease {held.lease.lease_id} is damaged")
        block.state = _State.READY
        if key in self._blocks:  # a writer reserved the key meanwhile: keep a private copy
            block.indexed = False
            self._private.add(block)
        else:
            self._blocks[key] = block
            self._policy.insert(key)
        self._counters["promotions"] += 1
        if self._thread is not None and self._pool.used_bytes > self._high_bytes:
            self._cond.notify_all()
        if held.lease not in self._leases:  # released while we read
            self._unpin_block_locked(block)
            raise StoreError(f"lease {held.lease.lease_id} was released during the read")
        held.dram[index] = block
        return self._view(block)

    # -- writes --------------------------------------------------------------------------------

    def begin_write(self, namespace: bytes, block_hash: bytes, ident: bytes,
                    num_bytes: int) -> WriteSlot | None:
        key = self._key(namespace, block_hash)
        if num_bytes < 0:
            raise StoreError("num_bytes must be >= 0")
        with self._lock:
            self._check_open()
            if self._pool.reserved_size(num_bytes) > self._pool.capacity_bytes:
                self._counters["put_too_large"] += 1
                raise StoreError(f"a {num_bytes} B block can never fit the "
                                 f"{self._pool.capacity_bytes} B DRAM pool")
            alloc = None
            while True:
                verdict = self._admit_locked(key, ident)
                if verdict is not None:
                    if alloc is not None:
                        self._pool.free(alloc)
                    self._counters[verdict] += 1
                    return None
                if alloc is not None:
                    break
                alloc = self._allocate_locked(num_bytes)  # may drop the lock: check again
            block = _Block(key, bytes(ident), alloc, _State.IN_FLIGHT)
            self._blocks[key] = block
            return _Slot(self, block, self._pool.view(alloc))

    def _admit_locked(self, key: bytes, ident: bytes) -> str | None:
        """None when a new block may be written under ``key``; else the counter saying why not."""
        cur = self._blocks.get(key)
        if cur is not None:
            if cur.ident == ident:
                self._policy.touch(key)
                return "duplicate_puts"
            if cur.state is not _State.READY or cur.pins or cur.demoting:
                return "put_collisions_dropped"
            self._drop_block_locked(cur)  # an unpinned block with another ident: newest wins
            self._counters["collisions_replaced"] += 1
        if self._ssd is not None:
            entry = self._ssd.lookup(key)
            if entry is not None:
                if entry.ident == ident:
                    self._ssd.touch_many([entry])
                    return "duplicate_puts"
                if self._ssd.remove(entry):
                    self._counters["collisions_replaced"] += 1
        return None

    def _commit(self, block: _Block) -> bool:
        with self._lock:
            if block.state is not _State.IN_FLIGHT or self._blocks.get(block.key) is not block:
                return False
            pad = self._pool.view(block.alloc, padded=True)[block.alloc.num_bytes:]
            pad[:] = bytes(len(pad))  # stale bytes of an older block never reach the SSD
            block.state = _State.READY
            self._policy.insert(block.key)
            self._counters["puts"] += 1
            self._counters["put_bytes"] += block.alloc.num_bytes
            if self._thread is not None and self._pool.used_bytes > self._high_bytes:
                self._cond.notify_all()
            return True

    def _abort(self, block: _Block) -> None:
        with self._lock:
            if block.state is _State.IN_FLIGHT and self._blocks.get(block.key) is block:
                del self._blocks[block.key]
                self._pool.free(block.alloc)
                self._counters["aborts"] += 1

    # -- making room ---------------------------------------------------------------------------

    def _allocate_locked(self, num_bytes: int) -> Allocation:
        """DRAM for ``num_bytes``: evict, or demote synchronously, the LRU unpinned blocks.

        May release and retake the lock. StoreError when every remaining byte is pinned.
        """
        need = self._pool.reserved_size(num_bytes)
        while True:
            self._check_open()
            alloc = self._pool.allocate(num_bytes)
            if alloc is not None:
                return alloc
            num_freed, dirty = self._free_victims_locked(need, batch_bytes=need)
            if dirty:
                self._demote_locked(dirty, keep=False)
                continue
            if num_freed:
                continue
            if self._num_demoting:
                self._cond.wait(0.05)  # another thread's demotion will free room
                continue
            if self._expire_leases_locked(time.monotonic()):
                continue
            raise StoreError("DRAM pool is full of pinned or in-flight blocks")

    def _free_victims_locked(self, need: int, batch_bytes: int) -> tuple[int, list[_Block]]:
        """Free LRU blocks that cost no IO, up to ``need`` bytes; returns (#freed, dirty).

        No IO is needed for a block when there is no SSD tier (it is evicted) or when the SSD
        already holds it (it is released). ``dirty`` (empty once ``need`` is freed) is up to
        ``batch_bytes`` of LRU blocks the SSD lacks, for the caller to demote.
        """
        clean: list[_Block] = []
        dirty: list[_Block] = []
        freed = dirty_bytes = 0
        for key in self._policy.victims():
            block = self._blocks[key]
            if block.pins or block.demoting:
                continue
            size = block.alloc.reserved_bytes
            if self._ssd is None or self._ssd.contains(key, block.ident):
                clean.append(block)
                freed += size
            elif dirty_bytes < batch_bytes:
                dirty.append(block)
                dirty_bytes += size
            if freed >= need or (dirty_bytes >= batch_bytes and freed + dirty_bytes >= need):
                break
        for block in clean:
            self._drop_block_locked(block)
            self._counters["evictions" if self._ssd is None else "dram_releases"] += 1
        return len(clean), ([] if freed >= need else dirty)

    def _demote_locked(self, batch: list[_Block], keep: bool) -> int:
        """Write ``batch`` to SSD with the lock released; free each block after, unless ``keep``
        or pinned. A block the SSD refused is evicted (unless kept or pinned). Returns #written.
        """
        for block in batch:
            block.demoting = True
        self._num_demoting += len(batch)
        items = [SSDWrite(b.key, b.ident, self._pool.view(b.alloc, padded=True),
                          b.alloc.num_bytes) for b in batch]
        results = [False] * len(batch)
        self._lock.release()
        try:
            results = self._ssd.write_many(items)
        except Exception as exc:
            log.error("demotion of %d block(s) failed: %s", len(batch), exc)
        finally:
            self._lock.acquire()
            self._num_demoting -= len(batch)
            self._cond.notify_all()
        num_written = 0
        for block, ok in zip(batch, results):
            block.demoting = False
            num_written += ok
            self._counters["demotions" if ok else "demotion_failures"] += 1
            if keep or block.pins or self._blocks.get(block.key) is not block:
                continue
            self._drop_block_locked(block)
            if not ok:
                self._counters["evictions"] += 1
        return num_written

    def _drop_block_locked(self, block: _Block) -> None:
        del self._blocks[block.key]
        self._policy.remove(block.key)
        self._pool.free(block.alloc)

    def _demote_loop(self) -> None:
        with self._lock:
            while not self._closed:
                progressed = False
                while not self._closed and self._pool.used_bytes > self._low_bytes and (
                        progressed or self._pool.used_bytes > self._high_bytes):
                    excess = self._pool.used_bytes - self._low_bytes
                    num_freed, dirty = self._free_victims_locked(excess, DEMOTE_BATCH_BYTES)
                    if dirty:
                        self._demote_locked(dirty, keep=False)
                    elif not num_freed:
                        break  # the rest is pinned, in flight or being demoted
                    progressed = True
                if not self._closed:
                    self._cond.wait(_IDLE_WAKE_S)

    def flush_to_ssd(self) -> int:
        """Write every DRAM block that the SSD lacks to SSD, keeping DRAM copies; returns #written.

        For tests, tools and graceful shutdown: afterwards a restart from ``ssd_dir`` serves every
        block that was ready when this was called (and that fit on SSD).
        """
        if self._ssd is None:
            return 0
        num_written = 0
        with self._lock:
            self._check_open()
            # A snapshot, each block tried once: an SSD smaller than DRAM evicts earlier ones.
            todo = [b for b in self._blocks.values() if b.state is _State.READY]
            while todo:
                batch, batch_bytes = [], 0
                while todo and batch_bytes < DEMOTE_BATCH_BYTES:
                    block = todo.pop()
                    if (self._blocks.get(block.key) is block and not block.demoting
                            and not self._ssd.contains(block.key, block.ident)):
                        batch.append(block)
                        batch_bytes += block.alloc.reserved_bytes
                if batch:
                    num_written += self._demote_locked(batch, keep=True)
            while self._num_demoting and not self._closed:  # the demotion thread's batch too
                self._cond.wait(0.1)
        return num_written

    # -- removal and leases --------------------------------------------------------------------

    def remove(self, namespace: bytes, block_hash: bytes) -> bool:
        key = self._key(namespace, block_hash)
        with self._lock:
            self._check_open()
            block = self._blocks.get(key)
            if block is not None and (block.pins or block.demoting
                                      or block.state is not _State.READY):
                return False
            entry = self._ssd.lookup(key) if self._ssd is not None else None
            if entry is not None and entry.pins:
                return False
            if block is not None:
                self._drop_block_locked(block)
        # The SSD drop commits to LMDB (an fsync): done off the store lock. A lease taken on
        # the SSD copy in between wins (the entry stays).
        removed = block is not None
        if entry is not None:
            removed = self._ssd.remove(entry) or removed
        if removed:
            with self._lock:
                self._counters["removes"] += 1
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

    def _release_locked(self, lease: Lease) -> None:
        held = self._leases.pop(lease)
        if held is None:
            return
        for block in held.dram:
            if block is not None:
                self._unpin_block_locked(block)
        for entry in held.ssd:
            if entry is not None:
                self._ssd.unpin(entry)
        self._cond.notify_all()

    def _unpin_block_locked(self, block: _Block) -> None:
        block.pins -= 1
        if block.pins == 0 and not block.indexed:
            self._private.discard(block)
            self._pool.free(block.alloc)

    # -- reporting and lifecycle ---------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
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
            live = list(self._blocks.values()) + list(self._private)
            assert sorted((b.alloc.offset, b.alloc.reserved_bytes) for b in live) == \
                self._pool.allocations(), "DRAM allocations differ from the blocks that own them"
            ready = {k for k, b in self._blocks.items() if b.state is _State.READY}
            assert set(self._policy.victims()) == ready, "policy tracks other keys than READY"
            assert all(b.key == k and b.indexed for k, b in self._blocks.items())
            pins: Counter[int] = Counter()
            for held in self._leases:
                assert not held.lease.released, "a released lease is still held"
                assert len(held.keys) == len(held.dram) == len(held.ssd)
                for block, entry in zip(held.dram, held.ssd):
                    assert block is not None or entry is not None, "a lease slot pins nothing"
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
        return self._keys(namespace, [block_hash])[0]

    def _keys(self, namespace: bytes, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Index keys: namespace || hash (truncated in debug mode). StoreError on bad sizes."""
        if len(namespace) != HASH_BYTES or (block_hashes and
                                             set(map(len, block_hashes)) != {HASH_BYTES}):
            raise StoreError(f"namespace and block hashes must be {HASH_BYTES} bytes each")
        namespace = bytes(namespace)
        bits = self.config.debug_hash_bits
        if bits is None:
            return [namespace + h for h in block_hashes]  # bytes + any buffer is bytes
        return [namespace + truncate_hash(bytes(h), bits) for h in block_hashes]

    def _view(self, block: _Block) -> memoryview:
        return self._pool.view(block.alloc).toreadonly()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

