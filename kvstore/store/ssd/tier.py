"""The SSD tier: blocks in preallocated data files, carved by offset allocators, indexed by LMDB.

Durability order: a block's bytes are written and fdatasync'ed first, its index entry is committed
after, and only then is it visible. The entry's checksum is XXH3-128 over key, ident and bytes, so
a stale entry whose slot was reused, a flipped byte or a truncated file all fail verification and
become a miss (the entry is dropped and counted), never other bytes. Slots of dropped entries may
be reused before their delete is committed: the delete is queued at the drop and every commit
carries all queued deletes, so it lands no later than the write that reused the slot; a crash in
between leaves a stale entry that fails its checksum. A missing or unreadable index starts the
tier empty.

Thread-safe: one lock guards the in-memory index, the policy and the allocators; IO, fsync and
index commits run outside it. Entries being read or pinned by a lease are never evicted.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import xxhash

from kvstore.store.allocator import Allocation, OffsetAllocator, align_up
from kvstore.store.eviction import make_policy
from kvstore.store.ssd.files import ALIGNMENT, IO_MODES, OS_FILE_OPS, DataFiles, FileOps, ShortIO
from kvstore.store.ssd.index import SSDEntry, SSDIndex, layout_key

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_FILE_BYTES", "IO_MODES", "SSDEntry", "SSDTier", "SSDWrite",
           "block_checksum"]

DEFAULT_MAX_FILE_BYTES = 4 << 30
MAX_KEY_BYTES = 511  # LMDB's key limit
# Every outcome the tier counts, present from the start so exported series never appear late.
COUNTERS = (
    "writes", "write_bytes", "write_rejected", "write_no_room", "write_errors", "enospc",
    "reads", "read_bytes", "corrupt", "read_errors", "evictions", "replaced", "removes",
    "lost_at_start", "index_resets", "index_commit_failures", "layout_resets", "sparse_files",
    "direct_io_fallbacks",
)


def block_checksum(key: bytes, ident: bytes, data: bytes | memoryview) -> bytes:
    """XXH3-128 binding the bytes to their key and ident (a reused slot cannot pass for another)."""
    h = xxhash.xxh3_128()
    h.update(struct.pack("<II", len(key), len(ident)))
    h.update(key)
    h.update(ident)
    h.update(data)
    return h.digest()


class SSDWrite(NamedTuple):
    """One block to write: ``data`` holds its ``num_bytes``, optionally followed by padding."""

    key: bytes
    ident: bytes
    data: memoryview
    num_bytes: int


class SSDTier:
    """Blocks on local disk under ``ssd_dir``, at most ``capacity_bytes`` of data files.

    ``io_mode``: "auto" (O_DIRECT when the filesystem takes it), "direct" (required: OSError if
    refused) or "buffered". Raises OSError (EBUSY) if another process holds ``ssd_dir``.
    ``file_ops`` makes the data files' IO calls (tests inject faults through it).
    """

    def __init__(self, ssd_dir: Path | str, capacity_bytes: int, eviction: str = "lru",
                 io_mode: str = "auto", max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 durable: bool = True, file_ops: FileOps = OS_FILE_OPS) -> None:
        num_files = max(1, -(-capacity_bytes // max(max_file_bytes, ALIGNMENT)))
        file_bytes = capacity_bytes // num_files // ALIGNMENT * ALIGNMENT
        if file_bytes <= 0:
            raise ValueError(f"SSD capacity {capacity_bytes} is below one {ALIGNMENT} B unit")
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {IO_MODES}, got {io_mode!r}")
        self.file_bytes = file_bytes
        self.capacity_bytes = file_bytes * num_files
        self.dir = Path(ssd_dir)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._durable = durable
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._index: dict[bytes, SSDEntry] = {}
        self._policy = make_policy(eviction)
        self._pending: set[bytes] = set()  # keys being written: not visible, not rewritten
        self._zombies: set[SSDEntry] = set()  # dropped while pinned: slot freed at last unpin
        self._commits_in_flight = 0
        self._closed = False
        # Told the key of every entry dropped for good (not one rewritten in place), under this
        # tier's lock: it must only take note (TieredStore reports drops outside its locks).
        self.on_drop: Callable[[bytes], None] | None = None
        self._lock_fd = self._take_dir_lock()
        db = None
        try:
            had_data = any(self.dir.glob("data-*.bin"))
            reserve = min(max(self.capacity_bytes // 2048, 1 << 20), 512 << 20)
            db = SSDIndex(self.dir / "index.lmdb", layout_key(num_files, file_bytes, ALIGNMENT),
                          reserve, durable, ALIGNMENT, had_data, self._counters)
            self._files = DataFiles(self.dir, num_files, file_bytes, io_mode, self._counters,
                                    file_ops)
        except BaseException:
            if db is not None:
                db.close()
            os.close(self._lock_fd)
            raise
        self._db = db
        self._allocators = [OffsetAllocator(file_bytes, ALIGNMENT) for _ in range(num_files)]
        self._load_index()
        log.info("SSD tier %s: %d file(s) of %d B, %d block(s), io_mode=%s (%s)", self.dir,
                 num_files, file_bytes, len(self._index), self.io_mode, self.io_mode_reason)

    @property
    def io_mode(self) -> str:
        return self._files.io_mode

    @property
    def io_mode_reason(self) -> str:
        return self._files.io_mode_reason

    # -- lookups and pins ----------------------------------------------------------------------

    def lookup(self, key: bytes) -> SSDEntry | None:
        """The live entry for ``key`` (its ident is for the caller to compare), not pinned."""
        with self._lock:
            return self._index.get(key)

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[SSDEntry]:
        """Live entries of ``keys`` in order, up to the first key not held; not pinned."""
        out: list[SSDEntry] = []
        with self._lock:
            index = self._index
            for key in keys:
                entry = index.get(key)
                if entry is None:
                    break
                out.append(entry)
        return out

    def contains(self, key: bytes, ident: bytes) -> bool:
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and entry.ident == ident

    def pin(self, entry: SSDEntry) -> bool:
        """Pin a looked-up entry against eviction; False if it was dropped meanwhile."""
        return self.pin_many([entry]) == 1

    def pin_many(self, entries: Sequence[SSDEntry]) -> int:
        """Pin entries in order up to the first one dropped meanwhile; returns how many."""
        with self._lock:
            for n, entry in enumerate(entries):
                if not entry.live:
                    return n
                entry.pins += 1
            return len(entries)

    def unpin(self, entry: SSDEntry) -> None:
        with self._lock:
            self._unpin_locked(entry)

    def touch_many(self, entries: Sequence[SSDEntry]) -> None:
        """Record accesses (for the eviction order) of the live ones among ``entries``."""
        with self._lock:
            for entry in entries:
                if entry.live:
                    self._policy.touch(entry.key)

    # -- write path ----------------------------------------------------------------------------

    def write_many(self, items: Sequence[SSDWrite]) -> list[bool]:
        """Make each block durable, evicting the oldest unpinned blocks for room.

        Per item True when the block is on SSD afterwards (written now or already there). False
        when it cannot be stored (larger than a data file, everything pinned, IO error, disk
        full); never raises for those.
        """
        results = [False] * len(items)
        plans: list[tuple[int, SSDWrite, int, Allocation]] = []
        dropped: list[SSDEntry] = []
        with self._lock:
            self._check_open()
            for i, item in enumerate(items):
                if len(item.key) > MAX_KEY_BYTES or item.num_bytes > self.file_bytes:
                    self._counters["write_rejected"] += 1
                    continue
                if item.key in self._pending:
                    continue
                cur = self._index.get(item.key)
                if cur is not None:
                    if cur.ident == item.ident:
                        results[i] = True
                        continue
                    if cur.pins:
                        continue
                    self._drop_locked(cur, dropped, "replaced")
                placed = self._place_locked(item.num_bytes, dropped)
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
                        self._allocators[entry.file_idx].free(entry.alloc)
                    self._counters["index_commit_failures"] += 1
                    self._counters["write_errors"] += len(written)
                written = []
        finally:
            with self._lock:
                self._commits_in_flight -= 1
                for _, item, _, _ in plans:
                    self._pending.discard(item.key)
                for entry in written:
                    self._index[entry.key] = entry
                    self._policy.insert(entry.key)
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
                    full = exc.errno == errno.ENOSPC
                    with self._lock:
                        self._allocators[file_idx].free(alloc)
                        self._counters["enospc" if full else "write_errors"] += 1
                        # A slot that held an older block is backed by real disk blocks.
                        placed = (self._reuse_slot_locked(item.num_bytes, dropped)
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
                log.error("fdatasync of %s failed: %s", self._files.paths[file_idx], exc)
                lost = [e for e in written if e.file_idx == file_idx]
                written = [e for e in written if e.file_idx != file_idx]
                with self._lock:
                    for entry in lost:
                        self._allocators[file_idx].free(entry.alloc)
                    self._counters["write_errors"] += len(lost)
        return written

    def _place_locked(self, num_bytes: int, dropped: list[SSDEntry]):
        """(file, slot) in the file with most free space, evicting the oldest unpinned blocks."""
        order = sorted(range(len(self._allocators)), key=lambda i: -self._allocators[i].free_bytes)
        while True:
            for file_idx in order:
                alloc = self._allocators[file_idx].allocate(num_bytes)
                if alloc is not None:
                    return file_idx, alloc
            victim = self._next_victim_locked()
            if victim is None:
                return None
            self._drop_locked(victim, dropped, "evictions")

    def _reuse_slot_locked(self, num_bytes: int, dropped: list[SSDEntry]):
        need = align_up(max(num_bytes, 1), ALIGNMENT)
        while (victim := self._next_victim_locked()) is not None:
            self._drop_locked(victim, dropped, "evictions")
            if victim.alloc.reserved_bytes >= need:
                alloc = self._allocators[victim.file_idx].allocate_at(victim.alloc.offset,
                                                                      num_bytes)
                if alloc is not None:
                    return victim.file_idx, alloc
        return None

    def _next_victim_locked(self) -> SSDEntry | None:
        for key in self._policy.victims():
            entry = self._index[key]
            if entry.pins == 0:
                return entry
        return None

    # -- read path -----------------------------------------------------------------------------

    def read_into(self, entry: SSDEntry, dest: memoryview) -> bool:
        """Fill ``dest[:num_bytes]`` with the verified block; False (entry dropped) if damaged.

        ``dest`` may be longer (padding up to the reserved size lets O_DIRECT read in place).
        """
        with self._lock:
            self._check_open()
            if not entry.live:
                return False
            entry.pins += 1
        ok, reason = False, "read_errors"
        try:
            self._files.read(entry.file_idx, entry.alloc.offset, entry.alloc.reserved_bytes,
                             entry.num_bytes, dest)
            ok = block_checksum(entry.key, entry.ident, dest[:entry.num_bytes]) == entry.checksum
            reason = "corrupt"
        except ShortIO:
            ok, reason = False, "corrupt"
        except OSError as exc:
            log.error("SSD read from %s failed: %s", self._files.paths[entry.file_idx], exc)
            ok = False
        finally:
            dropped: list[SSDEntry] = []
            with self._lock:
                self._unpin_locked(entry)
                if ok:
                    self._counters["reads"] += 1
                    self._counters["read_bytes"] += entry.num_bytes
                elif entry.live:
                    self._drop_locked(entry, dropped, reason)
        if dropped:
            log.warning("SSD block at %s+%d dropped: %s",
                        self._files.paths[entry.file_idx].name, entry.alloc.offset, reason)
            self._db.commit([], dropped)
        return ok

    # -- removal -------------------------------------------------------------------------------

    def remove(self, entry: SSDEntry) -> bool:
        """Drop an unpinned entry; False if pinned or already gone."""
        dropped: list[SSDEntry] = []
        with self._lock:
            self._check_open()
            if not entry.live or entry.pins:
                return False
            self._drop_locked(entry, dropped, "removes")
        self._db.commit([], dropped)
        return True

    def _drop_locked(self, entry: SSDEntry, dropped: list[SSDEntry], counter: str) -> None:
        if not entry.live:
            return
        entry.live = False
        del self._index[entry.key]
        self._policy.remove(entry.key)
        self._counters[counter] += 1
        dropped.append(entry)
        self._db.note_delete(entry)  # any commit from now on carries it; see SSDIndex
        if self.on_drop is not None and counter != "replaced":
            self.on_drop(entry.key)
        if entry.pins == 0:
            self._allocators[entry.file_idx].free(entry.alloc)
        else:
            self._zombies.add(entry)

    def _unpin_locked(self, entry: SSDEntry) -> None:
        if entry.pins <= 0:
            raise ValueError("unpin of an unpinned SSD entry")
        entry.pins -= 1
        if entry.pins == 0 and not entry.live:
            self._zombies.discard(entry)
            self._allocators[entry.file_idx].free(entry.alloc)

    # -- reporting and lifecycle ---------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self._allocators)

    def locate(self, key: bytes) -> tuple[Path, int, int] | None:
        """(data file, offset, num_bytes) of a block: for tools and damage tests."""
        with self._lock:
            e = self._index.get(key)
            return None if e is None else (self._files.paths[e.file_idx], e.alloc.offset,
                                           e.num_bytes)

    def stats(self) -> dict:
        with self._lock:
            return {
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self.used_bytes,
                "blocks": len(self._index),
                "files": len(self._allocators),
                "io_mode": self.io_mode,
                "io_mode_reason": self.io_mode_reason,
                "pinned_blocks": sum(1 for e in self._index.values() if e.pins),
                "counters": dict(self._counters),
            }

    def check_integrity(self) -> None:
        """Allocators tile their files; index, policy, allocations (and LMDB when idle) agree."""
        with self._lock:
            held: list[set[tuple[int, int]]] = [set() for _ in self._allocators]
            for allocator in self._allocators:
                allocator.check_integrity()
            for key, e in self._index.items():
                assert e.live and e.key == key, f"index entry {key.hex()} is not live"
                held[e.file_idx].add((e.alloc.offset, e.alloc.reserved_bytes))
            assert set(self._policy.victims()) == set(self._index), "policy and index differ"
            if self._commits_in_flight or self._pending:
                return
            for e in self._zombies:
                held[e.file_idx].add((e.alloc.offset, e.alloc.reserved_bytes))
            for i, allocator in enumerate(self._allocators):
                assert set(allocator.allocations()) == held[i], f"file {i}: allocations"
            on_disk, deferred = self._db.keys()
            assert set(self._index) <= on_disk, "a visible block is not in LMDB"
            assert on_disk - set(self._index) <= deferred, "LMDB holds dropped blocks"

    def close(self) -> None:
        """Close the files and the index (everything visible is already durable)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._db.close()
        self._files.close()
        os.close(self._lock_fd)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SSD tier is closed")

    def _take_dir_lock(self) -> int:
        fd = os.open(self.dir / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OSError(errno.EBUSY, f"{self.dir} is in use by another kvstore process") from None
        return fd

    def _load_index(self) -> None:
        entries, bad = self._db.load()
        kept: list[SSDEntry] = []
        for entry in sorted(entries, key=lambda e: -e.seq):  # on overlap the newest wins
            fits = (entry.file_idx < len(self._allocators) and entry.alloc.offset % ALIGNMENT == 0
                    and entry.alloc.offset + entry.num_bytes
                    <= self._files.valid_bytes[entry.file_idx])
            if fits and self._allocators[entry.file_idx].allocate_at(
                    entry.alloc.offset, entry.num_bytes) is not None:
                kept.append(entry)
            else:
                bad.append(entry.key)
        for entry in reversed(kept):
            self._index[entry.key] = entry
            self._policy.insert(entry.key)  # oldest written first: restart keeps write order
        self._next_seq = max((e.seq for e in kept), default=0) + 1
        if bad:
            log.warning("SSD index: %d entr(ies) damaged or pointing at missing, truncated or "
                        "overlapping data", len(bad))
            self._counters["lost_at_start"] += len(bad)
            self._db.delete_keys(bad)
