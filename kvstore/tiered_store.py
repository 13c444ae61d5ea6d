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
"""

from __future__ import annotations

import contextlib
import enum
import logging
import operator
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

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


@dataclass(eq=False, slots=True)
class _Block:
    key: bytes
    ident: bytes
    alloc: Allocation
    state: _State
    pins: int = 0  # leases holding it, plus one while a promotion fills it
    demoting: bool = False  # its bytes are being written to SSD: not freed meanwhile
    indexed: bool = True  # False: a lease's private copy (its key was taken meanwhile)


# Stands in for a block DRAM lacks in a lookup: its ident equals no ident, and it is never
# indexed (a _Block, so that the lookup's attribute reads see one type).
_ABSENT = _Block(b"", object(), None, _State.IN_FLIGHT)  # type: ignore[arg-type]
_NO_BLOCKS: dict[bytes, _Block] = {}  # never written: the READY index of an unknown namespace
_BAD_SIZES = f"namespace and block hashes must be {HASH_BYTES} bytes each"
_PROBE_BLOCKS = 32  # a lookup finds this many blocks before it looks any further


def _verified_len(found: list[_Block], stored_idents: list, idents: list) -> int:
    """How many blocks, from the first, DRAM holds (``found``) with the idents asked for."""
    try:
        end = found.index(_ABSENT)
    except ValueError:
        end = len(found)
    if stored_idents[:end] == idents[:end]:
        return end
    same = list(map(operator.eq, stored_idents[:end], idents[:end]))
    return same.index(False) if False in same else end


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

    def _find_ready_locked(self, namespace: bytes,
                           hashes: Sequence[bytes]) -> tuple[list[_Block], Sequence[bytes]]:
        """Each hash's READY block in DRAM, or _ABSENT; and the hashes, as bytes if need be.

        Without an SSD tier a hit cannot go past a block DRAM lacks, so the list may stop after
        the first of them: a cold miss looks at a few hashes, not at all of them.
        """
        ready = self._ready.get(namespace, _NO_BLOCKS)
        try:
            found = list(map(ready.get, hashes[:_PROBE_BLOCKS], repeat(_ABSENT)))
            if len(hashes) > _PROBE_BLOCKS and (self._ssd is not None or _ABSENT not in found):
                found += map(ready.get, hashes[_PROBE_BLOCKS:], repeat(_ABSENT))
        except TypeError:  # unhashable buffers (bytearray): look them up as bytes
            return self._find_ready_locked(namespace, [bytes(memoryview(h)) for h in hashes])
        return found, hashes

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

    def _promote_locked(self, held: HeldLease, index: int) -> memoryview:
        """Copy the lease's SSD block ``index`` into DRAM (once, however many readers ask)."""
        entry = held.ssd[index]
        key = entry.key
        while True:
            if held.ssd[index] is not entry:
                raise StoreError(f"block {index} of lease {held.lease.lease_id} was done "
                                 "while it was read")
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
            if held.ssd[index] is not entry or key in self._promoting or (
                    cur is not None and cur.state is _State.READY and cur.ident == entry.ident):
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
            self._ready_put(block)
            self._policy.insert(key)
        self._counters["promotions"] += 1
        if self._thread is not None and self._pool.used_bytes > self._high_bytes:
            self._cond.notify_all()
        if held.lease not in self._leases or held.ssd[index] is not entry:
            self._unpin_block_locked(block)  # released, or this block done, while we read
            raise StoreError(f"block {index} of lease {held.lease.lease_id} was let go during "
                             "the read")
        held.dram[index] = block
        return self._view(block)

    # -- writes --------------------------------------------------------------------------------

    def begin_write(self, namespace: bytes, block_hash: bytes, ident: bytes,
                    num_bytes: int) -> WriteSlot | None:
        try:
            return self._begin_write(namespace, block_hash, ident, num_bytes)
        finally:
            if self._dropped:  # room was made by evicting blocks
                self._report_dropped()

    def _begin_write(self, namespace: bytes, block_hash: bytes, ident: bytes,
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
        self._count_pins_locked()
        cur = self._blocks.get(key)
        if cur is not None:
            if cur.ident == ident:
                self._policy.touch(key)
                return "duplicate_puts"
            if cur.state is not _State.READY or cur.pins or cur.demoting:
                return "put_collisions_dropped"
            self._drop_block_locked(cur)  # an unpinned block with another ident: newest wins
            self._note_drop(key)  # a drop only if the new block never arrives
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
            self._ready_put(block)
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
        self._count_pins_locked()
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
            if self._ssd is None:
                self._counters["evictions"] += 1
                self._note_drop(block.key)
            else:
                self._counters["dram_releases"] += 1  # the SSD holds it
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
        self._count_pins_locked()  # leases granted while the lock was down
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
                self._note_drop(block.key)
        return num_written

    def _drop_block_locked(self, block: _Block) -> None:
        del self._blocks[block.key]
        if block.state is _State.READY:
            self._ready_drop(block)
        self._policy.remove(block.key)
        self._pool.free(block.alloc)

    def _ready_put(self, block: _Block) -> None:
        namespace, block_hash = block.key[:HASH_BYTES], block.key[HASH_BYTES:]
        blocks = self._ready.get(namespace)
        if blocks is None:
            blocks = self._ready[namespace] = {}
        blocks[block_hash] = block

    def _ready_drop(self, block: _Block) -> None:
        namespace = block.key[:HASH_BYTES]
        blocks = self._ready[namespace]
        del blocks[block.key[HASH_BYTES:]]
        if not blocks:
            del self._ready[namespace]  # namespaces come and go (the bytes API names them)

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
                if self._dropped:  # reported without the lock: the hook may take its own
                    self._lock.release()
                    try:
                        self._report_dropped()
                    finally:
                        self._lock.acquire()
                    continue
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
        if self._dropped:  # the SSD evicted older blocks to take these
            self._report_dropped()
        return num_written

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

    def _release_locked(self, lease: Lease) -> None:
        held = self._leases.pop(lease)
        if held is None:
            return
        if not held.counted:  # its DRAM blocks never left the index: record the access only
            del self._uncounted[lease.lease_id]
            touch = self._policy.touch
            for block in held.dram:
                if block is not None:
                    touch(block.key)
        else:
            for block in held.dram:
                if block is not None:
                    self._unpin_block_locked(block)
        if any(held.ssd):
            for entry in held.ssd:
                if entry is not None:
                    self._ssd.unpin(entry)
        self._cond.notify_all()

    def _count_pins_locked(self) -> None:
        """Count every lease's DRAM blocks into their ``pins``.

        Whatever reads ``pins`` to free, evict, demote or replace a block calls this first, in
        the same hold of the lock: then a block is pinned iff its ``pins`` is non-zero.
        """
        if self._uncounted:
            for held in list(self._uncounted.values()):
                self._count_lease_pins_locked(held)

    def _count_lease_pins_locked(self, held: HeldLease) -> None:
        if held.counted:
            return
        for block in held.dram:
            if block is not None:
                block.pins += 1
        held.counted = True
        del self._uncounted[held.lease.lease_id]

    def _unpin_block_locked(self, block: _Block) -> None:
        block.pins -= 1
        if block.indexed:
            # The access a leased lookup made is recorded here: the block could not be evicted
            # before, so its place in the eviction order did not matter until now.
            self._policy.touch(block.key)
        elif block.pins == 0:
            self._private.discard(block)
            self._pool.free(block.alloc)

    # -- drop reports --------------------------------------------------------------------------

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

    def _view(self, block: _Block) -> memoryview:
        return self._pool.view(block.alloc).toreadonly()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

