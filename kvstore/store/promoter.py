"""Promotion: copying a leased SSD block into DRAM when its reader asks for it.

Each key is promoted once however many readers ask (the others wait on the store's condition).
The SSD read runs with the store's lock released, into a fresh IN_FLIGHT block pinned by the
promotion; a writer that reserves the key meanwhile wins the index, and the promoted copy stays
private to the lease.
"""

from __future__ import annotations

from kvstore.store.block_store import BlockUnavailable, StoreError
from kvstore.store.demoter import Demoter
from kvstore.store.dram.blocks import Block, BlockState
from kvstore.store.lease_pins import LeasePins
from kvstore.store.leases import HeldLease
from kvstore.store.parts import StoreParts


class Promoter:
    """Promotes leased SSD blocks into DRAM; ``promote_locked`` runs under the store's lock."""

    def __init__(self, parts: StoreParts, leases: LeasePins, demoter: Demoter) -> None:
        self._guard = parts.guard
        self._dram = parts.dram
        self._backing = parts.backing
        self._leases = leases
        self._demoter = demoter
        self._counters = parts.counters
        self._promoting: dict[bytes, Block] = {}  # by key: the blocks being read from SSD

    @property
    def busy(self) -> bool:
        return bool(self._promoting)

    def blocks(self) -> list[Block]:
        """The blocks being filled right now (each pinned once by its promotion)."""
        return list(self._promoting.values())

    def promote_locked(self, held: HeldLease, index: int) -> memoryview:
        """Copy the lease's SSD block ``index`` into DRAM (once, however many readers ask)."""
        self._dram.count_lease_pins(held)  # the promoted block is pinned one by one
        entry = held.ssd[index]
        key = entry.key
        cond = self._guard.cond
        while True:
            if held.ssd[index] is not entry:
                raise StoreError(f"block {index} of lease {held.lease.lease_id} was done "
                                 "while it was read")
            cur = self._dram.lookup(key)
            if cur is not None and cur.state is BlockState.READY and cur.ident == entry.ident:
                self._dram.pin_many([cur])  # someone promoted or re-put it meanwhile
                held.dram[index] = cur
                self._dram.touch(key)
                return self._dram.view(cur)
            if key in self._promoting:
                cond.wait()
                held = self._leases.live(held.lease)
                continue
            try:
                alloc = self._demoter.allocate_locked(entry.num_bytes)  # may drop the lock
            except StoreError as exc:
                self._counters["promotion_failures"] += 1
                raise BlockUnavailable(f"no DRAM to promote into: {exc}") from None
            try:
                held = self._leases.live(held.lease)
            except StoreError:
                self._dram.pool.free(alloc)
                raise
            cur = self._dram.lookup(key)
            if held.ssd[index] is not entry or key in self._promoting or (
                    cur is not None and cur.state is BlockState.READY
                    and cur.ident == entry.ident):
                self._dram.pool.free(alloc)  # promoted or re-put while we made room: use that
                continue
            break
        block = Block(key, entry.ident, alloc, BlockState.IN_FLIGHT, pins=1)
        self._promoting[key] = block
        cond.release()
        try:
            ok = self._backing.read_into(entry, self._dram.view(block, padded=True))
        except BaseException:
            ok = False
            raise
        finally:
            cond.acquire()
            del self._promoting[key]
            cond.notify_all()
            if not ok:
                self._dram.pool.free(alloc)
                self._counters["promotion_failures"] += 1
        if not ok:
            raise BlockUnavailable(f"block {index} of lease {held.lease.lease_id} is damaged")
        if key in self._dram:  # a writer reserved the key meanwhile: keep a private copy
            self._dram.keep_private(block)
        else:
            self._dram.publish(block)
        self._counters["promotions"] += 1
        self._demoter.note_growth_locked()
        if not self._leases.holds(held.lease) or held.ssd[index] is not entry:
            self._dram.unpin(block)  # released, or this block done, while we read
            raise StoreError(f"block {index} of lease {held.lease.lease_id} was let go during "
                             "the read")
        held.dram[index] = block
        return self._dram.view(block)
