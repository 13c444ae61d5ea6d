"""Making room in DRAM: evicting, or demoting to SSD, the least recently used unpinned blocks.

When DRAM use passes the high watermark a background thread writes LRU unpinned blocks to SSD
and frees their DRAM once the SSD copy is durable, down to the low watermark; a block being
demoted stays readable. Without an SSD tier (the backing tier is the null tier: not
``enabled``) there is no thread: eviction costs no IO, so room is made on demand
(``allocate``). SSD IO runs with the store's lock released, on blocks marked ``demoting``
(their DRAM bytes cannot be freed or reused meanwhile).
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore.store.allocator import Allocation
from kvstore.store.block_store import StoreError
from kvstore.store.dram.blocks import Block
from kvstore.store.lease_pins import LeasePins
from kvstore.store.parts import StoreParts
from kvstore.store.store_tier import BlockWrite

log = logging.getLogger("kvstore.store.tiered")  # the store's logger, as before the split

DEMOTE_BATCH_BYTES = 64 << 20
_IDLE_WAKE_S = 1.0  # the demotion thread rechecks pressure at least this often


class Demoter:
    """Frees DRAM for new blocks, and (with an SSD tier) runs the demotion thread.

    Methods ending in ``_locked`` run under the store's lock and may release and retake it.
    """

    def __init__(self, parts: StoreParts, leases: LeasePins, high_watermark: float,
                 low_watermark: float) -> None:
        self._guard = parts.guard
        self._dram = parts.dram
        self._pool = parts.dram.pool
        self._backing = parts.backing
        # Blocks DRAM cannot keep go to the backing tier; with it switched off they are evicted.
        self._demotes = parts.backing.enabled
        self._leases = leases
        self._drops = parts.drops
        self._counters = parts.counters
        self._high_bytes = int(self._pool.capacity_bytes * high_watermark)
        self._low_bytes = int(self._pool.capacity_bytes * low_watermark)
        self.num_demoting = 0  # blocks being written to SSD right now
        self._thread: threading.Thread | None = None
        if self._demotes:
            self._thread = threading.Thread(target=self._demote_loop, name="kvstore-demote",
                                            daemon=True)
            self._thread.start()

    def note_growth_locked(self) -> None:
        """DRAM use grew: wake the demotion thread if it passed the high watermark."""
        if self._thread is not None and self._pool.used_bytes > self._high_bytes:
            self._guard.cond.notify_all()

    def allocate_locked(self, num_bytes: int) -> Allocation:
        """DRAM for ``num_bytes``: evict, or demote synchronously, the LRU unpinned blocks.

        May release and retake the lock. StoreError when every remaining byte is pinned.
        """
        need = self._pool.reserved_size(num_bytes)
        while True:
            self._guard.check_open()
            alloc = self._pool.allocate(num_bytes)
            if alloc is not None:
                return alloc
            num_freed, dirty = self._free_victims_locked(need, batch_bytes=need)
            if dirty:
                self._demote_locked(dirty, keep=False)
                continue
            if num_freed:
                continue
            if self.num_demoting:
                self._guard.cond.wait(0.05)  # another thread's demotion will free room
                continue
            if self._leases.expire(time.monotonic()):
                continue
            raise StoreError("DRAM pool is full of pinned or in-flight blocks")

    def _free_victims_locked(self, need: int, batch_bytes: int) -> tuple[int, list[Block]]:
        """Free LRU blocks that cost no IO, up to ``need`` bytes; returns (#freed, dirty).

        No IO is needed for a block when there is no SSD tier (it is evicted) or when the SSD
        already holds it (it is released). ``dirty`` (empty once ``need`` is freed) is up to
        ``batch_bytes`` of LRU blocks the SSD lacks, for the caller to demote.
        """
        clean: list[Block] = []
        dirty: list[Block] = []
        freed = dirty_bytes = 0
        for block in self._dram.victims():
            size = block.alloc.reserved_bytes
            if not self._demotes or self._backing.contains(block.key, block.ident):
                clean.append(block)
                freed += size
            elif dirty_bytes < batch_bytes:
                dirty.append(block)
                dirty_bytes += size
            if freed >= need or (dirty_bytes >= batch_bytes and freed + dirty_bytes >= need):
                break
        for block in clean:
            self._dram.drop(block)
            if self._demotes:
                self._counters["dram_releases"] += 1  # the SSD holds it
            else:
                self._counters["evictions"] += 1
                self._drops.note(block.key)
        return len(clean), ([] if freed >= need else dirty)

    def _demote_locked(self, batch: list[Block], keep: bool) -> int:
        """Write ``batch`` to SSD with the lock released; free each block after, unless ``keep``
        or pinned. A block the SSD refused is evicted (unless kept or pinned). Returns #written.
        """
        for block in batch:
            block.demoting = True
        self.num_demoting += len(batch)
        items = [BlockWrite(b.key, b.ident, self._dram.view(b, padded=True), b.alloc.num_bytes)
                 for b in batch]
        results = [False] * len(batch)
        cond = self._guard.cond
        cond.release()
        try:
            results = self._backing.write_many(items)
        except Exception as exc:
            log.error("demotion of %d block(s) failed: %s", len(batch), exc)
        finally:
            cond.acquire()
            self.num_demoting -= len(batch)
            cond.notify_all()
        num_written = 0
        for block, ok in zip(batch, results):
            block.demoting = False
            num_written += ok
            self._counters["demotions" if ok else "demotion_failures"] += 1
            # is_pinned counts leases granted while the lock was down
            if keep or self._dram.is_pinned(block) or not self._dram.holds(block):
                continue
            self._dram.drop(block)
            if not ok:
                self._counters["evictions"] += 1
                self._drops.note(block.key)
        return num_written

    def _demote_loop(self) -> None:
        guard, cond, pool = self._guard, self._guard.cond, self._pool
        with cond:
            while not guard.closed:
                progressed = False
                while not guard.closed and pool.used_bytes > self._low_bytes and (
                        progressed or pool.used_bytes > self._high_bytes):
                    excess = pool.used_bytes - self._low_bytes
                    num_freed, dirty = self._free_victims_locked(excess, DEMOTE_BATCH_BYTES)
                    if dirty:
                        self._demote_locked(dirty, keep=False)
                    elif not num_freed:
                        break  # the rest is pinned, in flight or being demoted
                    progressed = True
                if self._drops.pending:  # reported without the lock: the hook may take its own
                    cond.release()
                    try:
                        self._drops.report()
                    finally:
                        cond.acquire()
                    continue
                if not guard.closed:
                    cond.wait(_IDLE_WAKE_S)

    def flush_locked(self) -> int:
        """Write every DRAM block that the SSD lacks to SSD, keeping DRAM copies; #written."""
        if not self._demotes:
            return 0
        num_written = 0
        self._guard.check_open()
        # A snapshot, each block tried once: an SSD smaller than DRAM evicts earlier ones.
        todo = self._dram.ready_blocks()
        while todo:
            batch, batch_bytes = [], 0
            while todo and batch_bytes < DEMOTE_BATCH_BYTES:
                block = todo.pop()
                if (self._dram.holds(block) and not block.demoting
                        and not self._backing.contains(block.key, block.ident)):
                    batch.append(block)
                    batch_bytes += block.alloc.reserved_bytes
            if batch:
                num_written += self._demote_locked(batch, keep=True)
        while self.num_demoting and not self._guard.closed:  # the demotion thread's batch too
            self._guard.cond.wait(0.1)
        return num_written

    def join(self) -> None:
        """Wait for the demotion thread to end (after the store was marked closed)."""
        if self._thread is not None:
            self._thread.join()
