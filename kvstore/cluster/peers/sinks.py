"""Where a peer's answer lands: pooled receive buffers (``fetch``) or the local store's write
slots (``fetch_into``), and the result a ``fetch`` returns.

A receive buffer is never reused, and a write slot never aborted, while UCX may still write into
it: ``abandon`` lets each go only once its UCX request has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from kvstore.store.block_store import BlockStore, StoreError, WriteSlot

log = logging.getLogger("kvstore.cluster.peers.client")  # the client's logger, as before the split


@dataclass
class FetchResult:
    """The verified prefix of blocks a peer sent, and why it stopped short.

    ``blocks`` are read-only views into a receive buffer that is reused once the result is
    released: use it as a context manager, or call ``release()``, after copying the blocks out.
    An unreleased result just leaves its buffer to the garbage collector.
    """

    blocks: list[memoryview]
    error: str | None = None  # None, or the kind of failure counted in PeerClient.stats()
    _buffer: np.ndarray | None = field(default=None, repr=False)
    _pool: BufferPool | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the receive buffer back; the views must not be used after this."""
        for view in self.blocks:
            with contextlib.suppress(BufferError):  # still exported: the contract alone holds
                view.release()
        self.blocks = []
        if self._pool is not None and self._buffer is not None:
            self._pool.put(self._buffer)
        self._buffer = self._pool = None

    def __enter__(self) -> FetchResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BufferPool:
    """Receive buffers kept for reuse: fresh memory costs a page fault per 4 KiB on first touch,
    which on a fast link costs more than the transfer. Thread-safe; bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def get(self, num_bytes: int) -> np.ndarray:
        with self._lock:
            fits = [b for b in self._free if num_bytes <= b.nbytes <= 2 * num_bytes + (1 << 20)]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free.remove(best)
                return best
        return np.empty(-(-num_bytes // (1 << 20)) << 20, dtype=np.uint8)  # whole MiBs

    def put(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._free.append(buffer)
            total = sum(b.nbytes for b in self._free)
            while self._free and total > self.max_bytes:
                total -= self._free.pop(0).nbytes  # the oldest goes first


class BufferSink:
    """Receives an answer into one pooled buffer."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.buffer: np.ndarray | None = None

    async def reserve(self, entries: list[list]) -> list[memoryview]:
        self.buffer = self.pool.get(sum(e[2] for e in entries))
        views, offset = [], 0
        for entry in entries:
            views.append(memoryview(self.buffer[offset:offset + entry[2]]))
            offset += entry[2]
        return views

    def abandon(self, tasks: list[asyncio.Task | None]) -> None:
        self.buffer = None  # UCX holds it while a request lives; it never returns to the pool


class SlotSink:
    """Receives an answer straight into the store's write slots, reserved on a worker thread
    (making room may wait on the store's lock or its SSD). A block the store already holds is
    drained into scratch memory."""

    def __init__(self, store: BlockStore, namespace: bytes) -> None:
        self.store, self.namespace = store, namespace
        self.slots: list[WriteSlot | None] = []
        self.refused = False  # the store had no room for the next block
        self._abandoned = False
        self._lock = threading.Lock()

    async def reserve(self, entries: list[list]) -> list[memoryview]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._reserve, entries)

    def _reserve(self, entries: list[list]) -> list[memoryview]:
        targets: list[memoryview] = []
        for block_hash, ident, num_bytes, _ in entries:
            try:
                slot = self.store.begin_write(self.namespace, block_hash, ident, num_bytes)
            except StoreError as exc:
                log.info("no room for a fetched block: %s", exc)
                self.refused = True
                break
            with self._lock:
                if self._abandoned:  # the fetch failed meanwhile: nothing will fill it
                    if slot is not None:
                        slot.abort()
                    break
                self.slots.append(slot)
            targets.append(slot.buffer if slot is not None
                           else memoryview(np.empty(num_bytes, dtype=np.uint8)))
        return targets

    def abandon(self, tasks: list[asyncio.Task | None]) -> None:
        with self._lock:
            self._abandoned = True
            slots = list(self.slots)
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            task = tasks[i] if i < len(tasks) else None
            if task is None or task.done():
                slot.abort()
            else:
                task.add_done_callback(lambda _task, s=slot: s.abort())

    def abort_all(self) -> None:
        for slot in self.slots:
            if slot is not None:
                slot.abort()
