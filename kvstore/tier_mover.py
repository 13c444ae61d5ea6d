"""Moving blocks between the tiered store's DRAM and SSD: demotion, promotion, making room."""

from __future__ import annotations

import logging
import time

from kvstore.allocator import Allocation
from kvstore.block_store import BlockUnavailable, StoreError
from kvstore.dram_blocks import _Block, _State
from kvstore.leases import HeldLease
from kvstore.ssd_tier import SSDWrite

log = logging.getLogger("kvstore.tiered_store")  # the store's logger, as before the split

DEMOTE_BATCH_BYTES = 64 << 20
_IDLE_WAKE_S = 1.0  # the demotion thread rechecks pressure at least this often


class TierMover:
    """The TieredStore's demotion thread, promotions and eviction; ``*_locked`` need its lock.

    A mixin: it uses the store's lock, pool, SSD tier, index, policy, leases and counters.
    """

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
