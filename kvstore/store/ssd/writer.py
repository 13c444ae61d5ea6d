"""The SSD tier's write path: placing blocks, writing and syncing their bytes, committing their
index entries, and only then making them visible.

Durability order: a block's bytes are written and fdatasync'ed first, its LMDB entry is committed
after, and only then is it in the catalog (visible). A key being written is "pending": not
visible, not written again meanwhile. IO runs outside the tier's lock.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.store.allocator import Allocation
from kvstore.store.ssd.catalog import SSDCatalog
from kvstore.store.ssd.files import DataFiles
from kvstore.store.ssd.index import SSDEntry, SSDIndex, block_checksum
from kvstore.store.store_tier import BlockWrite

log = logging.getLogger("kvstore.store.ssd.tier")  # the tier's logger, as before the split

MAX_KEY_BYTES = 511  # LMDB's key limit


class SSDWriter:
    """Writes blocks to the tier's data files; shares the tier's lock, catalog and counters."""

    def __init__(self, lock: threading.Lock, catalog: SSDCatalog, files: DataFiles,
                 db: SSDIndex, counters: Counter[str], file_bytes: int, durable: bool,
                 check_open: Callable[[], None], next_seq: int) -> None:
        self._lock = lock
        self._catalog = catalog
        self._files = files
        self._db = db
        self._counters = counters
        self.file_bytes = file_bytes
        self._durable = durable
        self._check_open = check_open
        self._next_seq = next_seq
        self._pending: set[bytes] = set()  # keys being written: not visible, not rewritten
        self._commits_in_flight = 0
        # Set at the first EROFS (ext4 remounts itself read-only after an error): no write can
        # succeed any more, so none is tried, and the tier says so once instead of per block.
        self.read_only_reason: str | None = None

    def idle_locked(self) -> bool:
        """No write between placement and publication (call with the tier's lock held)."""
        return not (self._commits_in_flight or self._pending)

    def write_many(self, items: Sequence[BlockWrite]) -> list[bool]:
        """Make each block durable, evicting the oldest unpinned blocks for room.

        Per item True when the block is on SSD afterwards (written now or already there). False
        when it cannot be stored (larger than a data file, everything pinned, IO error, disk
        full); never raises for those.
        """
        results = [False] * len(items)
        plans: list[tuple[int, BlockWrite, int, Allocation]] = []
        dropped: list[SSDEntry] = []
        with self._lock:
            self._check_open()
            if self.read_only_reason is not None:
                self._counters["write_read_only"] += len(items)
                return results
            for i, item in enumerate(items):
                if len(item.key) > MAX_KEY_BYTES or item.num_bytes > self.file_bytes:
                    self._counters["write_rejected"] += 1
                    continue
                if item.key in self._pending:
                    continue
                cur = self._catalog.get(item.key)
                if cur is not None:
                    if cur.ident == item.ident:
                        results[i] = True
                        continue
                    if cur.pins:
                        continue
                    self._catalog.drop(cur, dropped, "replaced")
                placed = self._catalog.place(item.num_bytes, dropped)
                if placed is None:
                    self._counters["write_no_room"] += 1
                    continue
                self._pending.add(item.key)
                plans.append((i, item, *placed))
            self._commits_in_flight += 1
        written: list[SSDEntry] = []
        try:
            written = self._write_planned(plans, dropped)  # IO errors end in counted misses
            if not self._db.commit(written, dropped) and written:
                with self._lock:  # the blocks never became visible: give their slots back
                    for entry in written:
                        self._catalog.free(entry.file_idx, entry.alloc)
                    self._counters["index_commit_failures"] += 1
                    self._counters["write_errors"] += len(written)
                written = []
        finally:
            with self._lock:
                self._commits_in_flight -= 1
                for _, item, _, _ in plans:
                    self._pending.discard(item.key)
                for entry in written:
                    self._catalog.publish(entry)
                    self._counters["writes"] += 1
                    self._counters["write_bytes"] += entry.num_bytes
        done = {entry.key for entry in written}
        for i, item, _, _ in plans:
            results[i] = item.key in done
        return results

    def _write_planned(self, plans, dropped: list[SSDEntry]) -> list[SSDEntry]:
        written: list[SSDEntry] = []
        for _, item, file_idx, alloc in plans:
            checksum = block_checksum(item.key, item.ident, item.data[:item.num_bytes])
            placed: tuple[int, Allocation] | None = (file_idx, alloc)
            for attempt in (0, 1):
                file_idx, alloc = placed
                try:
                    self._files.write(file_idx, alloc.offset, alloc.reserved_bytes, item.data,
                                      item.num_bytes)
                    break
                except OSError as exc:
                    if exc.errno == errno.EROFS:
                        with self._lock:
                            self._catalog.free(file_idx, alloc)
                            self._counters["write_read_only"] += 1
                        self._note_read_only(exc)
                        placed = None
                        break
                    full = exc.errno == errno.ENOSPC
                    with self._lock:
                        self._catalog.free(file_idx, alloc)
                        self._counters["enospc" if full else "write_errors"] += 1
                        # A slot that held an older block is backed by real disk blocks.
                        placed = (self._catalog.reuse_slot(item.num_bytes, dropped)
                                  if full and attempt == 0 else None)
                    if placed is None:
                        log.warning("SSD write of %d B failed: %s", item.num_bytes, exc)
                        break
            if placed is None:
                continue
            with self._lock:
                seq = self._next_seq
                self._next_seq += 1
            written.append(SSDEntry(item.key, bytes(item.ident), file_idx, alloc, checksum, seq))
        if not self._durable:
            return written
        for file_idx in sorted({e.file_idx for e in written}):
            try:
                self._files.sync(file_idx)
            except OSError as exc:
                if exc.errno == errno.EROFS:
                    self._note_read_only(exc)
                else:
                    log.error("fdatasync of %s failed: %s", self._files.paths[file_idx], exc)
                lost = [e for e in written if e.file_idx == file_idx]
                written = [e for e in written if e.file_idx != file_idx]
                with self._lock:
                    for entry in lost:
                        self._catalog.free(file_idx, entry.alloc)
                    self._counters["write_errors"] += len(lost)
        return written

    def _note_read_only(self, exc: OSError) -> None:
        with self._lock:
            first = self.read_only_reason is None
            if first:
                self.read_only_reason = exc.strerror or str(exc)
        if first:
            log.warning("SSD filesystem under %s is read-only (%s): SSD writes stop, new blocks "
                        "stay in DRAM only", self._files.paths[0].parent, self.read_only_reason)
