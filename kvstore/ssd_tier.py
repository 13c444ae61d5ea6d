"""The SSD tier: preallocated data files carved by offset allocators, indexed by LMDB.

Durability order: a block's bytes are written and fdatasync'ed first, its LMDB entry is committed
after, and only then is it visible. The entry holds (file, offset, length, seq, checksum, ident);
the checksum is XXH3-128 over key, ident and bytes, so a stale entry whose slot was reused, a
flipped byte or a truncated file all fail verification and become a miss (the entry is dropped and
counted), never other bytes. Slots of evicted entries may be reused before their LMDB delete is
committed (both land in one transaction): a crash in between leaves a stale entry that fails its
checksum. A missing or unreadable index starts the tier empty; it never stops the daemon.

IO is O_DIRECT from aligned buffers where the filesystem allows it (probed at open; EINVAL falls
back to buffered IO + fdatasync), ``io_mode`` and the reason are in ``stats()``. Thread-safe: one
lock guards the index and the allocators; IO, fsync and LMDB commits run outside it. Entries being
read or leased are pinned and never evicted.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import struct
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lmdb
import numpy as np
import xxhash

from kvstore.allocator import Allocation, OffsetAllocator, align_up
from kvstore.eviction import make_policy

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ALIGNMENT = 4096
DEFAULT_MAX_FILE_BYTES = 4 << 30
IO_MODES = ("auto", "direct", "buffered")
MAX_KEY_BYTES = 511  # LMDB's key limit
_ENTRY = struct.Struct("<HQQQ16s")  # file, offset, num_bytes, seq, checksum; then ident, xxh64
_LAYOUT = struct.Struct("<IIQI")  # format version, num files, file bytes, alignment
_O_DIRECT = getattr(os, "O_DIRECT", 0)
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


@dataclass(eq=False)
class SSDEntry:
    """A durable block. ``live`` turns False once dropped; a pinned slot is freed at last unpin."""

    key: bytes
    ident: bytes
    file_idx: int
    alloc: Allocation
    checksum: bytes
    seq: int
    pins: int = 0
    live: bool = True

    @property
    def num_bytes(self) -> int:
        return self.alloc.num_bytes

    def encode(self) -> bytes:
        head = _ENTRY.pack(self.file_idx, self.alloc.offset, self.alloc.num_bytes, self.seq,
                           self.checksum) + self.ident
        return head + xxhash.xxh64_digest(head)


def _decode_entry(key: bytes, value: bytes) -> SSDEntry | None:
    if len(value) < _ENTRY.size + 8 or xxhash.xxh64_digest(value[:-8]) != value[-8:]:
        return None
    file_idx, offset, num_bytes, seq, checksum = _ENTRY.unpack_from(value)
    alloc = Allocation(offset, num_bytes, align_up(max(num_bytes, 1), ALIGNMENT))
    return SSDEntry(key, bytes(value[_ENTRY.size:-8]), file_idx, alloc, checksum, seq)


class _ShortIO(OSError):
    pass


# LMDB does not checksum its pages: a truncated or scribbled index can SIGBUS or abort() the
# process that walks it. So the first walk happens in a throwaway child process.
_PROBE = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=2, subdir=True)
with env.begin() as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
for name in names:
    with env.begin(db=env.open_db(name, create=False)) as txn:
        for _ in txn.cursor():
            pass
"""


def _probe_index(path: Path, timeout_s: float = 120.0) -> str | None:
    """None when a child process can walk the whole index, else what went wrong."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot probe the SSD index in a child process (%s); opening it directly",
                    exc)
        return None
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        return f"walking it killed a probe process with signal {-proc.returncode}"
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"probe exited with {proc.returncode}"


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


@dataclass(eq=False)
class _DataFile:
    path: Path
    fd: int  # buffered; used for fdatasync and in buffered mode
    io_fd: int  # O_DIRECT in direct mode, else == fd
    valid_bytes: int  # size found at open: entries ending past it were lost
    allocator: OffsetAllocator


class SSDTier:
    """Blocks on local disk under ``ssd_dir``, at most ``capacity_bytes`` of data files.

    ``io_mode``: "auto" (O_DIRECT when the filesystem takes it), "direct" (required) or
    "buffered". Raises OSError if ``ssd_dir`` is held by another live process.
    """

    def __init__(self, ssd_dir: Path | str, capacity_bytes: int, eviction: str = "lru",
                 io_mode: str = "auto", max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 durable: bool = True) -> None:
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {IO_MODES}, got {io_mode!r}")
        num_files = max(1, -(-capacity_bytes // max(max_file_bytes, ALIGNMENT)))
        self.file_bytes = capacity_bytes // num_files // ALIGNMENT * ALIGNMENT
        if self.file_bytes <= 0:
            raise ValueError(f"SSD capacity {capacity_bytes} is below one {ALIGNMENT} B unit")
        self.capacity_bytes = self.file_bytes * num_files
        self.dir = Path(ssd_dir)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._durable = durable
        self._lock = threading.Lock()
        self._lmdb_lock = threading.Lock()  # our txns in turn, so the map can grow between them
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._index: dict[bytes, SSDEntry] = {}
        self._policy = make_policy(eviction)
        self._pending: set[bytes] = set()  # keys being written: not visible, not rewritten
        self._zombies: set[SSDEntry] = set()  # dropped while pinned: slot freed at last unpin
        self._deferred_deletes: list[SSDEntry] = []  # LMDB deletes a failed commit left behind
        self._commits_in_flight = 0
        self._closed = False
        self._lock_fd = self._take_dir_lock()
        self._layout = _LAYOUT.pack(FORMAT_VERSION, num_files, self.file_bytes, ALIGNMENT)
        self._open_index()
        self._files = [self._open_file(i) for i in range(num_files)]
        self._remove_stale_files(num_files)
        self._load_index()
        self.io_mode, self.io_mode_reason = self._choose_io_mode(io_mode)
        log.info("SSD tier %s: %d file(s) of %d B, %d block(s), io_mode=%s %s", self.dir,
                 num_files, self.file_bytes, len(self._index), self.io_mode, self.io_mode_reason)

    # -- lookups and pins ----------------------------------------------------------------------

    def lookup(self, key: bytes) -> SSDEntry | None:
        """The live entry for ``key`` (its ident is for the caller to compare), not pinned."""
        with self._lock:
            return self._index.get(key)

    def acquire(self, key: bytes) -> SSDEntry | None:
        """Like ``lookup`` but pinned: the caller must ``unpin`` it."""
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                entry.pins += 1
            return entry

    def pin(self, entry: SSDEntry) -> bool:
        """Pin a looked-up entry against eviction; False if it was dropped meanwhile."""
        with self._lock:
            if not entry.live:
                return False
            entry.pins += 1
            return True

    def unpin(self, entry: SSDEntry) -> None:
        with self._lock:
            self._unpin_locked(entry)

    def touch(self, entry: SSDEntry) -> None:
        with self._lock:
            if entry.live:
                self._policy.touch(entry.key)

    def contains(self, key: bytes, ident: bytes) -> bool:
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and entry.ident == ident

    # -- write path ----------------------------------------------------------------------------

    def write_many(self, items: Sequence[SSDWrite]) -> list[bool]:
        """Make each block durable, evicting the oldest unpinned blocks for room.

        Per item True when the block is on SSD afterwards (written now or already there). False
        when it cannot be stored (larger than a data file, everything pinned, IO error); never
        raises for those.
        """
        results = [False] * len(items)
        plans: list[tuple[int, SSDWrite, _DataFile, Allocation]] = []
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
            if not self._commit(written, dropped) and written:
                with self._lock:  # the blocks never became visible: give their slots back
                    for entry in written:
                        self._files[entry.file_idx].allocator.free(entry.alloc)
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
        touched: dict[int, list[SSDEntry]] = {}
        for _, item, f, alloc in plans:
            data = item.data[:item.num_bytes]
            checksum = block_checksum(item.key, item.ident, data)
            file_idx = self._files.index(f)
            for attempt in (0, 1):
                try:
                    self._write_at(f, alloc, item)
                    break
                except OSError as exc:
                    with self._lock:
                        f.allocator.free(alloc)
                        full = exc.errno == errno.ENOSPC
                        self._counters["enospc" if full else "write_errors"] += 1
                        again = None
                        if exc.errno == errno.ENOSPC and attempt == 0:
                            # A slot that held an older block is backed by real disk blocks.
                            again = self._reuse_slot_locked(item.num_bytes, dropped)
                    if again is None:
                        log.warning("SSD write of %d B failed: %s", item.num_bytes, exc)
                        alloc = None
                        break
                    f, alloc = again
                    file_idx = self._files.index(f)
            if alloc is None:
                continue
            with self._lock:
                seq = self._next_seq
                self._next_seq += 1
            entry = SSDEntry(item.key, bytes(item.ident), file_idx, alloc, checksum, seq)
            written.append(entry)
            touched.setdefault(file_idx, []).append(entry)
        if self._durable:
            for file_idx, entries in touched.items():
                try:
                    os.fdatasync(self._files[file_idx].fd)
                except OSError as exc:
                    log.error("fdatasync of %s failed: %s", self._files[file_idx].path, exc)
                    with self._lock:
                        for entry in entries:
                            self._files[file_idx].allocator.free(entry.alloc)
                        self._counters["write_errors"] += len(entries)
                    bad = set(map(id, entries))
                    written = [e for e in written if id(e) not in bad]
        return written

    def _write_at(self, f: _DataFile, alloc: Allocation, item: SSDWrite) -> None:
        if self.io_mode == "direct":
            src = item.data
            if len(src) >= alloc.reserved_bytes and _address(src) % ALIGNMENT == 0:
                src = src[:alloc.reserved_bytes]
            else:
                bounce = mmap.mmap(-1, alloc.reserved_bytes)
                bounce[:item.num_bytes] = item.data[:item.num_bytes]
                src = memoryview(bounce)
            try:
                n = os.pwritev(f.io_fd, [src], alloc.offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._fall_back_to_buffered(f"O_DIRECT write failed: {exc.strerror}")
                self._write_at(f, alloc, item)
                return
            if n != len(src):  # a regular file stops short when the disk is full
                raise _ShortIO(errno.ENOSPC, f"short O_DIRECT write ({n} of {len(src)} B)")
            return
        view = item.data[:item.num_bytes]
        done = 0
        while done < len(view):
            n = os.pwritev(f.fd, [view[done:]], alloc.offset + done)
            if n <= 0:
                raise _ShortIO(errno.ENOSPC, "write made no progress")
            done += n

    def _commit(self, puts: list[SSDEntry], deletes: list[SSDEntry]) -> bool:
        """One LMDB transaction; a delete only removes the exact entry (seq) that was dropped.

        False when LMDB refuses (disk full, IO error): nothing of it is visible, and the deletes
        are retried with the next commit (until then a restart may find those stale entries;
        their checksums fail).
        """
        with self._lmdb_lock:
            deletes = self._deferred_deletes + list(deletes)
            self._deferred_deletes = []
            if not puts and not deletes:
                return True
            while True:
                try:
                    with self._env.begin(write=True, db=self._db) as txn:
                        for entry in deletes:
                            value = txn.get(entry.key)
                            old = _decode_entry(entry.key, value) if value else None
                            if old is not None and old.seq == entry.seq:
                                txn.delete(entry.key)
                        for entry in puts:
                            txn.put(entry.key, entry.encode())
                    return True
                except lmdb.MapFullError:
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
                except lmdb.Error as exc:
                    log.error("SSD index commit failed: %s", exc)
                    self._deferred_deletes = deletes
                    return False

    def _place_locked(self, num_bytes: int, dropped: list[SSDEntry]):
        """A slot in the file with most free space, evicting the oldest unpinned blocks."""
        while True:
            for f in sorted(self._files, key=lambda f: -f.allocator.free_bytes):
                alloc = f.allocator.allocate(num_bytes)
                if alloc is not None:
                    return f, alloc
            victim = self._next_victim_locked()
            if victim is None:
                return None
            self._drop_locked(victim, dropped, "evictions")

    def _reuse_slot_locked(self, num_bytes: int, dropped: list[SSDEntry]):
        need = align_up(max(num_bytes, 1), ALIGNMENT)
        while (victim := self._next_victim_locked()) is not None:
            self._drop_locked(victim, dropped, "evictions")
            if victim.alloc.reserved_bytes >= need:
                f = self._files[victim.file_idx]
                alloc = f.allocator.allocate_at(victim.alloc.offset, num_bytes)
                if alloc is not None:
                    return f, alloc
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
            ok, reason = self._read_verified(entry, dest)
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
                            self._files[entry.file_idx].path.name, entry.alloc.offset, reason)
                self._commit([], dropped)
        return ok

    def _read_verified(self, entry: SSDEntry, dest: memoryview) -> tuple[bool, str]:
        f = self._files[entry.file_idx]
        n, reserved = entry.num_bytes, entry.alloc.reserved_bytes
        try:
            if self.io_mode == "direct":
                if len(dest) >= reserved and _address(dest) % ALIGNMENT == 0:
                    self._pread_direct(f, dest[:reserved], entry.alloc.offset)
                else:
                    bounce = mmap.mmap(-1, reserved)
                    self._pread_direct(f, memoryview(bounce), entry.alloc.offset)
                    dest[:n] = bounce[:n]
            else:
                done = 0
                while done < n:
                    got = os.preadv(f.fd, [dest[done:n]], entry.alloc.offset + done)
                    if got <= 0:
                        raise _ShortIO(errno.EIO, "short read")
                    done += got
        except _ShortIO:
            return False, "corrupt"
        except OSError as exc:
            log.error("SSD read from %s failed: %s", f.path, exc)
            return False, "read_errors"
        if block_checksum(entry.key, entry.ident, dest[:n]) != entry.checksum:
            return False, "corrupt"
        return True, ""

    def _pread_direct(self, f: _DataFile, buf: memoryview, offset: int) -> None:
        try:
            got = os.preadv(f.io_fd, [buf], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or self.io_mode != "direct":
                raise
            self._fall_back_to_buffered(f"O_DIRECT read failed: {exc.strerror}")
            got = os.preadv(f.fd, [buf], offset)
        if got != len(buf):
            raise _ShortIO(errno.EIO, f"short read ({got} of {len(buf)} B)")

    # -- removal -------------------------------------------------------------------------------

    def remove(self, entry: SSDEntry) -> bool:
        """Drop an unpinned entry; False if pinned or already gone."""
        dropped: list[SSDEntry] = []
        with self._lock:
            self._check_open()
            if not entry.live or entry.pins:
                return False
            self._drop_locked(entry, dropped, "removes")
        self._commit([], dropped)
        return True

    def _drop_locked(self, entry: SSDEntry, dropped: list[SSDEntry], counter: str) -> None:
        if not entry.live:
            return
        entry.live = False
        del self._index[entry.key]
        self._policy.remove(entry.key)
        self._counters[counter] += 1
        dropped.append(entry)
        if entry.pins == 0:
            self._files[entry.file_idx].allocator.free(entry.alloc)
        else:
            self._zombies.add(entry)

    def _unpin_locked(self, entry: SSDEntry) -> None:
        if entry.pins <= 0:
            raise ValueError("unpin of an unpinned SSD entry")
        entry.pins -= 1
        if entry.pins == 0 and not entry.live:
            self._zombies.discard(entry)
            self._files[entry.file_idx].allocator.free(entry.alloc)

    # -- reporting -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return sum(f.allocator.used_bytes for f in self._files)

    def locate(self, key: bytes) -> tuple[Path, int, int] | None:
        """(data file, offset, num_bytes) of a block: for tools and damage tests."""
        with self._lock:
            e = self._index.get(key)
            return None if e is None else (self._files[e.file_idx].path, e.alloc.offset,
                                           e.num_bytes)

    def stats(self) -> dict:
        with self._lock:
            return {
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self.used_bytes,
                "blocks": len(self._index),
                "files": len(self._files),
                "io_mode": self.io_mode,
                "io_mode_reason": self.io_mode_reason,
                "pinned_blocks": sum(1 for e in self._index.values() if e.pins),
                "counters": dict(self._counters),
            }

    def check_integrity(self) -> None:
        """Allocators tile their files; index, policy, allocations (and LMDB when idle) agree."""
        with self._lock:
            held: dict[int, set[tuple[int, int]]] = {i: set() for i in range(len(self._files))}
            for f in self._files:
                f.allocator.check_integrity()
            for key, e in self._index.items():
                assert e.live and e.key == key, f"index entry {key.hex()} is not live"
                held[e.file_idx].add((e.alloc.offset, e.alloc.reserved_bytes))
            assert set(self._policy.victims()) == set(self._index), "policy and index differ"
            if not self._commits_in_flight and not self._pending:
                for e in self._zombies:
                    held[e.file_idx].add((e.alloc.offset, e.alloc.reserved_bytes))
                for i, f in enumerate(self._files):
                    assert set(f.allocator.allocations()) == held[i], f"file {i}: allocations"
                with self._lmdb_lock, self._env.begin(db=self._db) as txn:
                    on_disk = {bytes(k) for k, _ in txn.cursor()}
                    deferred = {e.key for e in self._deferred_deletes}
                assert set(self._index) <= on_disk, "a visible block is not in LMDB"
                assert on_disk - set(self._index) <= deferred, "LMDB holds dropped blocks"

    def close(self) -> None:
        """Close files and the index. Everything visible was already durable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with self._lmdb_lock:
            self._env.sync(True)
            self._env.close()
        for f in self._files:
            if f.io_fd != f.fd:
                os.close(f.io_fd)
            os.close(f.fd)
        os.close(self._lock_fd)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SSD tier is closed")

    # -- opening -------------------------------------------------------------------------------

    def _take_dir_lock(self) -> int:
        fd = os.open(self.dir / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OSError(errno.EBUSY, f"{self.dir} is in use by another kvstore process") from None
        return fd

    def _open_index(self) -> None:
        path = self.dir / "index.lmdb"
        had_index = (path / "data.mdb").exists()
        had_data = any(self.dir.glob("data-*.bin"))
        problem = _probe_index(path) if had_index else None
        if problem is None:
            try:
                self._open_lmdb(path)
            except lmdb.Error as exc:
                problem = str(exc)
        if problem is not None:
            log.error("SSD index %s is unreadable (%s): starting the SSD tier empty", path,
                      problem)
            self._counters["index_resets"] += 1
            shutil.rmtree(path, ignore_errors=True)
            self._open_lmdb(path)
        else:
            if had_data and not had_index:
                log.warning("SSD index %s is missing: starting the SSD tier empty", path)
                self._counters["index_resets"] += 1

    def _open_lmdb(self, path: Path) -> None:
        path.mkdir(mode=0o700, exist_ok=True)
        data = path / "data.mdb"
        size = data.stat().st_size if data.exists() else 0
        reserve = min(max(self.capacity_bytes // 2048, 1 << 20), 512 << 20)
        size = max(size, reserve)
        env = lmdb.open(str(path), map_size=max(64 << 20, 2 * size), subdir=True, max_dbs=2,
                        sync=self._durable, metasync=self._durable, readahead=False)
        try:
            db = env.open_db(b"blocks")
            meta = env.open_db(b"meta")
            with env.begin(write=True) as txn:
                layout = txn.get(b"layout", db=meta)
                if layout != self._layout:
                    if layout is not None:
                        log.warning("SSD layout changed: dropping the old index")
                        self._counters["layout_resets"] += 1
                    txn.drop(db, delete=False)
                    txn.put(b"layout", self._layout, db=meta)
                for _ in txn.cursor(db=db):  # walk every entry now: a damaged tree raises here
                    pass
        except lmdb.Error:
            env.close()
            raise
        self._env, self._db = env, db
        # Room for the index is taken up front, beside the preallocated data files, so a disk
        # that fills up later does not stop index commits. (After LMDB wrote its meta pages: a
        # longer file is fine for it, a zero-filled new one is not.)
        if data.stat().st_size < reserve:
            fd = os.open(data, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.posix_fallocate(fd, 0, reserve)
            except OSError as exc:
                log.warning("cannot reserve %d B for the SSD index: %s", reserve, exc)
            finally:
                os.close(fd)

    def _open_file(self, i: int) -> _DataFile:
        path = self.dir / f"data-{i:03d}.bin"
        existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        size = os.fstat(fd).st_size
        if size > self.file_bytes:
            os.ftruncate(fd, self.file_bytes)
        elif size < self.file_bytes:
            try:
                os.posix_fallocate(fd, 0, self.file_bytes)
            except OSError as exc:  # no fallocate here, or not enough room: sparse, ENOSPC later
                log.warning("cannot preallocate %s (%s): using a sparse file", path, exc)
                self._counters["sparse_files"] += 1
                os.ftruncate(fd, self.file_bytes)
        valid = min(size, self.file_bytes) if existed else 0
        return _DataFile(path, fd, fd, valid, OffsetAllocator(self.file_bytes, ALIGNMENT))

    def _remove_stale_files(self, num_files: int) -> None:
        for path in self.dir.glob("data-*.bin"):
            stem = path.stem.removeprefix("data-")
            if stem.isdigit() and int(stem) >= num_files:
                path.unlink(missing_ok=True)

    def _load_index(self) -> None:
        entries: list[SSDEntry] = []
        bad: list[bytes] = []
        try:
            with self._env.begin(db=self._db) as txn:
                for key, value in txn.cursor():
                    entry = _decode_entry(bytes(key), bytes(value))
                    if entry is None or not self._fits(entry):
                        bad.append(bytes(key))
                    else:
                        entries.append(entry)
        except lmdb.Error as exc:
            log.error("SSD index unreadable while loading (%s): starting empty", exc)
            self._counters["index_resets"] += 1
            entries = []
            with self._env.begin(write=True) as txn:
                txn.drop(self._db, delete=False)
        kept: list[SSDEntry] = []
        for entry in sorted(entries, key=lambda e: -e.seq):  # on overlap the newest wins
            f = self._files[entry.file_idx]
            if f.allocator.allocate_at(entry.alloc.offset, entry.num_bytes) is None:
                bad.append(entry.key)
            else:
                kept.append(entry)
        for entry in reversed(kept):
            self._index[entry.key] = entry
            self._policy.insert(entry.key)  # oldest written first: restart keeps write order
        self._next_seq = max((e.seq for e in kept), default=0) + 1
        if bad:
            log.warning("SSD index: %d entr(ies) point at missing, truncated or overlapping data",
                        len(bad))
            self._counters["lost_at_start"] += len(bad)
            with self._env.begin(write=True, db=self._db) as txn:
                for key in bad:
                    txn.delete(key)

    def _fits(self, e: SSDEntry) -> bool:
        if e.file_idx >= len(self._files) or e.alloc.offset % ALIGNMENT:
            return False
        return e.alloc.offset + e.num_bytes <= self._files[e.file_idx].valid_bytes

    def _choose_io_mode(self, requested: str) -> tuple[str, str]:
        if requested == "buffered":
            return "buffered", "requested"
        if not _O_DIRECT:
            if requested == "direct":
                raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
            return "buffered", "O_DIRECT not available on this platform"
        opened: list[int] = []
        probe = mmap.mmap(-1, ALIGNMENT)
        try:
            for f in self._files:
                fd = os.open(f.path, os.O_RDWR | os.O_CLOEXEC | _O_DIRECT)
                opened.append(fd)
                os.preadv(fd, [memoryview(probe)], 0)  # EINVAL here when IO itself is refused
        except OSError as exc:
            for fd in opened:
                os.close(fd)
            if requested == "direct" or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            return "buffered", f"O_DIRECT refused by the filesystem ({exc.strerror})"
        for f, fd in zip(self._files, opened):
            f.io_fd = fd
        return "direct", "O_DIRECT accepted by the filesystem"

    def _fall_back_to_buffered(self, reason: str) -> None:
        # The O_DIRECT descriptors stay open until close(): another thread may be using one.
        with self._lock:
            if self.io_mode == "direct":
                log.warning("SSD tier falls back to buffered IO: %s", reason)
                self.io_mode, self.io_mode_reason = "buffered", reason
                self._counters["direct_io_fallbacks"] += 1
