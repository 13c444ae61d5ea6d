"""The SSD tier: blocks in preallocated data files, carved by offset allocators, indexed by LMDB.

Durability order: a block's bytes are written and fdatasync'ed first, its index entry is committed
after, and only then is it visible. The entry's checksum is XXH3-128 over key, ident and bytes, so
a stale entry whose slot was reused, a flipped byte or a truncated file all fail verification and
become a miss (the entry is dropped and counted), never other bytes. Slots of dropped entries may
be reused before their delete is committed: the delete is queued at the drop and every commit
carries all queued deletes, so it lands no later than the write that reused the slot; a crash in
between leaves a stale entry that fails its checksum. A missing or unreadable index starts the
tier empty.

Thread-safe: one lock guards the in-memory catalog (index, policy, allocators: ``catalog.py``);
IO, fsync and index commits run outside it. Entries being read or pinned by a lease are never
evicted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from kvstore.store.eviction import make_policy
from kvstore.store.ssd.catalog import SSDCatalog
from kvstore.store.ssd.dir_lock import DirLock
from kvstore.store.ssd.files import ALIGNMENT, IO_MODES, OS_FILE_OPS, DataFiles, FileOps, ShortIO
from kvstore.store.ssd.index import SSDEntry, SSDIndex, block_checksum, layout_key
from kvstore.store.ssd.room import index_reserve_bytes, tier_layout
from kvstore.store.ssd.writer import SSDWriter
from kvstore.store.store_tier import BackingTier, BlockWrite
from kvstore.tiers import Tier

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_FILE_BYTES", "IO_MODES", "SSDEntry", "SSDTier", "block_checksum"]

DEFAULT_MAX_FILE_BYTES = 4 << 30
# Every outcome the tier counts, present from the start so exported series never appear late.
COUNTERS = (
    "writes", "write_bytes", "write_rejected", "write_no_room", "write_errors", "enospc",
    "write_read_only", "reads", "read_bytes", "corrupt", "read_errors", "evictions", "replaced",
    "removes",
    "lost_at_start", "index_resets", "index_commit_failures", "layout_resets", "sparse_files",
    "direct_io_fallbacks",
)


class SSDTier(BackingTier[SSDEntry]):
    """Blocks on local disk under ``ssd_dir``, at most ``capacity_bytes`` of data files.

    ``io_mode``: "auto" (O_DIRECT when the filesystem takes it), "direct" (required: OSError if
    refused) or "buffered". Raises OSError (EBUSY) if another process holds ``ssd_dir``. A
    capacity beyond the free space is taken (sparse files, ENOSPC later, counted): the daemon
    refuses that at start (``room.check_room``); tests of a full disk rely on it here.
    ``file_ops`` makes the data files' IO calls (tests inject faults through it). ``on_drop``
    is told the key of every entry dropped for good (evicted, damaged, removed; not one
    rewritten in place), under this tier's lock: it must only take note (TieredStore reports
    drops outside its locks).
    """

    tier = Tier.SSD

    def __init__(self, ssd_dir: Path | str, capacity_bytes: int, eviction: str = "lru",
                 io_mode: str = "auto", max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 durable: bool = True, file_ops: FileOps = OS_FILE_OPS,
                 on_drop: Callable[[bytes], None] | None = None) -> None:
        num_files, file_bytes = tier_layout(capacity_bytes, max_file_bytes)
        if file_bytes <= 0:
            raise ValueError(f"SSD capacity {capacity_bytes} is below one {ALIGNMENT} B unit")
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {IO_MODES}, got {io_mode!r}")
        self.file_bytes = file_bytes
        self.capacity_bytes = file_bytes * num_files
        self.dir = Path(ssd_dir)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._closed = False
        self._dir_lock = DirLock(self.dir)
        db = None
        try:
            had_data = any(self.dir.glob("data-*.bin"))
            reserve = index_reserve_bytes(self.capacity_bytes)
            db = SSDIndex(self.dir / "index.lmdb", layout_key(num_files, file_bytes, ALIGNMENT),
                          reserve, durable, ALIGNMENT, had_data, self._counters)
            self._files = DataFiles(self.dir, num_files, file_bytes, io_mode, self._counters,
                                    file_ops)
        except BaseException:
            if db is not None:
                db.close()
            self._dir_lock.close()
            raise
        self._db = db
        self._catalog = SSDCatalog(num_files, file_bytes, make_policy(eviction), db,
                                   self._counters, on_drop)
        next_seq = self._load_index()
        self._writer = SSDWriter(self._lock, self._catalog, self._files, db, self._counters,
                                 file_bytes, durable, self._check_open, next_seq)
        log.info("SSD tier %s: %d file(s) of %d B, %d block(s), io_mode=%s (%s)", self.dir,
                 num_files, file_bytes, self._catalog.num_blocks, self.io_mode,
                 self.io_mode_reason)

    @property
    def enabled(self) -> bool:
        return True

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
            return self._catalog.get(key)

    def __contains__(self, key: bytes) -> bool:
        return self.lookup(key) is not None

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._catalog.keys())

    def lookup_prefix(self, keys: Iterable[bytes]) -> list[SSDEntry]:
        """Live entries of ``keys`` in order, up to the first key not held; not pinned."""
        with self._lock:
            return self._catalog.prefix(keys)

    def contains(self, key: bytes, ident: bytes) -> bool:
        with self._lock:
            entry = self._catalog.get(key)
            return entry is not None and entry.ident == ident

    def pin_many(self, entries: Sequence[SSDEntry]) -> int:
        """Pin entries in order up to the first one dropped meanwhile; returns how many."""
        with self._lock:
            return self._catalog.pin_many(entries)

    def unpin(self, entry: SSDEntry) -> None:
        with self._lock:
            self._catalog.unpin(entry)

    def touch_many(self, entries: Iterable[SSDEntry | None]) -> None:
        """Record accesses (for the eviction order) of the live ones among ``entries``."""
        with self._lock:
            self._catalog.touch_many(entries)

    # -- write path ----------------------------------------------------------------------------

    def write_many(self, items: Sequence[BlockWrite]) -> list[bool]:
        """Make each block durable, evicting the oldest unpinned blocks for room (see
        ``SSDWriter.write_many``)."""
        return self._writer.write_many(items)

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
                self._catalog.unpin(entry)
                if ok:
                    self._counters["reads"] += 1
                    self._counters["read_bytes"] += entry.num_bytes
                elif entry.live:
                    self._catalog.drop(entry, dropped, reason)
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
            self._catalog.drop(entry, dropped, "removes")
        self._db.commit([], dropped)
        return True

    # -- reporting and lifecycle ---------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._catalog.num_blocks

    @property
    def used_bytes(self) -> int:
        return self._catalog.used_bytes

    def locate(self, key: bytes) -> tuple[Path, int, int] | None:
        """(data file, offset, num_bytes) of a block: for tools and damage tests."""
        with self._lock:
            e = self._catalog.get(key)
            return None if e is None else (self._files.paths[e.file_idx], e.alloc.offset,
                                           e.num_bytes)

    def stats(self) -> dict:
        with self._lock:
            return {
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self.used_bytes,
                "blocks": self._catalog.num_blocks,
                "files": self._catalog.num_files,
                "file_bytes": self.file_bytes,
                "io_mode": self.io_mode,
                "io_mode_reason": self.io_mode_reason,
                "pinned_blocks": self._catalog.num_pinned,
                "read_only": self._writer.read_only_reason is not None,
                "counters": dict(self._counters),
                "enabled": True,
            }

    def check_integrity(self) -> None:
        """Allocators tile their files; index, policy, allocations (and LMDB when idle) agree."""
        with self._lock:
            idle = self._writer.idle_locked()
            self._catalog.check_integrity(idle)
            if not idle:
                return
            on_disk, deferred = self._db.keys()
            index = self._catalog.keys()
            assert index <= on_disk, "a visible block is not in LMDB"
            assert on_disk - index <= deferred, "LMDB holds dropped blocks"

    def close(self) -> None:
        """Close the files and the index (everything visible is already durable)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._db.close(read_only_reported=self._writer.read_only_reason is not None)
        self._files.close()
        self._dir_lock.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SSD tier is closed")

    def _load_index(self) -> int:
        """Take what LMDB holds; returns the sequence number the next write gets."""
        entries, bad = self._db.load()
        bad += self._catalog.load(entries, self._files.valid_bytes)
        if bad:
            log.warning("SSD index: %d entr(ies) damaged or pointing at missing, truncated or "
                        "overlapping data", len(bad))
            self._counters["lost_at_start"] += len(bad)
            self._db.delete_keys(bad)
        return self._catalog.max_seq() + 1
