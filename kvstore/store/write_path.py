"""The tiered store's write path: write slots, admission into DRAM, commit, abort, replace."""

from __future__ import annotations

import contextlib
import time

from kvstore.store.block_store import StoreError, WriteSlot
from kvstore.store.demoter import Demoter
from kvstore.store.dram.blocks import Block, BlockState
from kvstore.store.index_keys import IndexKeys
from kvstore.store.parts import StoreParts


class _Slot(WriteSlot):
    def __init__(self, writes: WritePath, block: Block, buffer: memoryview, address: int) -> None:
        self._writes, self._block, self.buffer, self.address = writes, block, buffer, address

    def commit(self) -> bool:
        published = self._writes.commit(self._block)
        self._retire()
        return published

    def abort(self) -> None:
        self._writes.abort(self._block)
        self._retire()

    def _retire(self) -> None:
        # Later writes through the slot then raise; if the caller still exports the buffer (a
        # NumPy array), the contract alone forbids them.
        with contextlib.suppress(BufferError):
            self.buffer.release()


class WritePath:
    """``begin_write`` and what a slot's commit or abort does to the DRAM tier."""

    def __init__(self, parts: StoreParts, keys: IndexKeys, demoter: Demoter) -> None:
        self._guard = parts.guard
        self._keys = keys
        self._dram = parts.dram
        self._pool = parts.dram.pool
        self._backing = parts.backing
        self._demoter = demoter
        self._drops = parts.drops
        self._counters = parts.counters

    def begin_write(self, namespace: bytes, block_hash: bytes, ident: bytes,
                    num_bytes: int) -> WriteSlot | None:
        """A slot for a new block, or None if the store keeps what it has (counted why)."""
        try:
            return self._begin_write(namespace, block_hash, ident, num_bytes)
        finally:
            if self._drops.pending:  # room was made by evicting blocks
                self._drops.report()

    def _begin_write(self, namespace: bytes, block_hash: bytes, ident: bytes,
                     num_bytes: int) -> WriteSlot | None:
        key = self._keys.key(namespace, block_hash)
        if num_bytes < 0:
            raise StoreError("num_bytes must be >= 0")
        with self._guard.cond:
            self._guard.check_open()
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
                alloc = self._demoter.allocate_locked(num_bytes)  # may drop the lock: again
            block = self._dram.reserve(key, bytes(ident), alloc)
            return _Slot(self, block, self._pool.view(alloc), self._pool.address(alloc))

    def _admit_locked(self, key: bytes, ident: bytes) -> str | None:
        """None when a new block may be written under ``key``; else the counter saying why not."""
        cur = self._dram.lookup(key)
        if cur is not None:
            if cur.ident == ident:
                self._dram.touch(key)
                return "duplicate_puts"
            if cur.state is not BlockState.READY or self._dram.is_pinned(cur) or cur.demoting:
                return "put_collisions_dropped"
            self._dram.drop(cur)  # an unpinned block with another ident: newest wins
            self._drops.note(key)  # a drop only if the new block never arrives
            self._counters["collisions_replaced"] += 1
        entry = self._backing.lookup(key)
        if entry is not None:
            if entry.ident == ident:
                self._backing.touch_many([entry])
                return "duplicate_puts"
            if self._backing.remove(entry):
                self._counters["collisions_replaced"] += 1
        return None

    def replace(self, namespace: bytes, block_hash: bytes, ident: bytes, data: memoryview,
                wait_s: float) -> bool:
        """Store ``data`` under the key, replacing the block it holds in every tier, if any.

        Atomic for readers: the new bytes are copied into DRAM first, off the index; then, in
        one hold of the store's lock, the old block leaves DRAM and SSD and the new one becomes
        READY, so a lookup finds the old block or the new one, never neither, never a mix.
        An old block being read (pinned by a lease), written or demoted is waited for, at most
        ``wait_s``; then StoreError. True when an older block was replaced.
        """
        key = self._keys.key(namespace, block_hash)
        num_bytes = data.nbytes
        with self._guard.cond:
            self._guard.check_open()
            if self._pool.reserved_size(num_bytes) > self._pool.capacity_bytes:
                self._counters["put_too_large"] += 1
                raise StoreError(f"a {num_bytes} B block can never fit the "
                                 f"{self._pool.capacity_bytes} B DRAM pool")
            alloc = self._demoter.allocate_locked(num_bytes)
        published = False
        try:
            # The allocation belongs to no block yet: nothing else reads or writes it.
            padded = self._pool.view(alloc, padded=True)
            padded[:num_bytes] = data
            padded[num_bytes:] = bytes(len(padded) - num_bytes)
            deadline = time.monotonic() + wait_s
            with self._guard.cond:
                while not self._may_replace_locked(key):
                    if time.monotonic() >= deadline:
                        self._counters["put_busy"] += 1
                        raise StoreError(f"put could not replace the value: its block stayed "
                                         f"in use (read, written or moved) for {wait_s:g} s")
                    self._guard.cond.wait(0.01)
                    self._guard.check_open()
                replaced = self._drop_for_replace_locked(key)
                block = self._dram.reserve(key, bytes(ident), alloc)
                self._dram.publish(block)
                published = True
                self._counters["puts"] += 1
                self._counters["put_bytes"] += num_bytes
                self._counters["puts_replaced"] += replaced
                self._demoter.note_growth_locked()
                return replaced
        finally:
            if not published:
                with self._guard.cond:
                    self._pool.free(alloc)

    def _may_replace_locked(self, key: bytes) -> bool:
        cur = self._dram.lookup(key)
        if cur is not None and (cur.state is not BlockState.READY or self._dram.is_pinned(cur)
                                or cur.demoting):
            return False
        entry = self._backing.lookup(key)
        return entry is None or not entry.pins

    def _drop_for_replace_locked(self, key: bytes) -> bool:
        """Drop the key's block from DRAM and SSD (checked unpinned); no drop is reported: the
        key stays held, by the block that replaces it."""
        cur = self._dram.lookup(key)
        if cur is not None:
            self._dram.drop(cur)
        entry = self._backing.lookup(key)
        # New lookups and pins need the store's lock, held here: the entry stays unpinned.
        removed = entry is not None and self._backing.remove(entry)
        if entry is not None and not removed:
            raise StoreError("the SSD copy of the value could not be removed")
        return cur is not None or removed

    def commit(self, block: Block) -> bool:
        """Publish a filled block; False if it was dropped meanwhile (the store closed...)."""
        with self._guard.cond:
            if block.state is not BlockState.IN_FLIGHT or not self._dram.holds(block):
                return False
            pad = self._pool.view(block.alloc, padded=True)[block.alloc.num_bytes:]
            pad[:] = bytes(len(pad))  # stale bytes of an older block never reach the SSD
            self._dram.publish(block)
            self._counters["puts"] += 1
            self._counters["put_bytes"] += block.alloc.num_bytes
            self._demoter.note_growth_locked()
            return True

    def abort(self, block: Block) -> None:
        """Give up a reserved block: its bytes are freed, no lookup ever saw it."""
        with self._guard.cond:
            if block.state is BlockState.IN_FLIGHT and self._dram.holds(block):
                self._dram.discard(block)
                self._counters["aborts"] += 1
