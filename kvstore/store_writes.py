"""The tiered store's write path: write slots, admission, commit and abort."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from kvstore.block_store import StoreError, WriteSlot
from kvstore.dram_blocks import _Block, _State

if TYPE_CHECKING:
    from kvstore.tiered_store import TieredStore


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


class StoreWrites:
    """``begin_write`` and what a slot's commit or abort does to the store.

    A mixin: it uses the store's lock, pool, index, policy, SSD tier and counters.
    """

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
