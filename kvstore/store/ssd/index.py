"""The SSD tier's index: an LMDB map from block key to where its durable bytes are.

Each value is (file, offset, length, seq, checksum) + ident + an XXH64 of all that, so a damaged
value is detected and dropped like damaged data. LMDB does not checksum its pages, and walking a
truncated or scribbled index can SIGBUS or abort() the process; so an existing index is first
walked by a throwaway child process, and if that fails the index is deleted and the tier starts
empty (counted in ``index_resets``). A changed layout (size, file count) also starts empty.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import xxhash

from kvstore.store.allocator import Allocation, align_up

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_ENTRY = struct.Struct("<HQQQ16s")  # file, offset, num_bytes, seq, checksum; then ident, xxh64
_LAYOUT = struct.Struct("<IIQI")  # format version, num files, file bytes, alignment

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



def block_checksum(key: bytes, ident: bytes, data: bytes | memoryview) -> bytes:
    """XXH3-128 binding the bytes to their key and ident (a reused slot cannot pass for another)."""
    h = xxhash.xxh3_128()
    h.update(struct.pack("<II", len(key), len(ident)))
    h.update(key)
    h.update(ident)
    h.update(data)
    return h.digest()


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


def decode_entry(key: bytes, value: bytes, alignment: int) -> SSDEntry | None:
    """The entry stored under ``key``, or None when the value is damaged."""
    if len(value) < _ENTRY.size + 8 or xxhash.xxh64_digest(value[:-8]) != value[-8:]:
        return None
    file_idx, offset, num_bytes, seq, checksum = _ENTRY.unpack_from(value)
    alloc = Allocation(offset, num_bytes, align_up(max(num_bytes, 1), alignment))
    return SSDEntry(key, bytes(value[_ENTRY.size:-8]), file_idx, alloc, checksum, seq)


def layout_key(num_files: int, file_bytes: int, alignment: int) -> bytes:
    return _LAYOUT.pack(FORMAT_VERSION, num_files, file_bytes, alignment)


def probe_index(path: Path, timeout_s: float = 120.0) -> str | None:
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


class SSDIndex:
    """The LMDB environment under ``path``; transactions are serialised by one lock.

    ``reserve_bytes`` of disk are taken for it up front, so a disk that fills up later does not
    stop index commits. ``had_data`` says data files exist: an index missing beside them is a
    reset (logged and counted), not a first start.
    """

    def __init__(self, path: Path, layout: bytes, reserve_bytes: int, durable: bool,
                 alignment: int, had_data: bool, counters: Counter[str]) -> None:
        self.path = path
        self._layout = layout
        self._durable = durable
        self._alignment = alignment
        self._counters = counters
        self._lock = threading.Lock()  # serialises transactions
        # Deletes not committed yet: noted when an entry is dropped, or left by a failed commit.
        # Every commit carries all of them: the slot of a dropped entry may be reused by another
        # thread's write at once, and that write's commit must delete the stale entry with it,
        # or a crash in between would leave both in LMDB over the same bytes.
        self._deferred: list[SSDEntry] = []
        self._deferred_lock = threading.Lock()  # a leaf: note_delete runs under the tier's lock
        had_index = (path / "data.mdb").exists()
        problem = probe_index(path) if had_index else None
        if problem is None:
            try:
                self._open(reserve_bytes)
            except lmdb.Error as exc:
                problem = str(exc)
        if problem is not None:
            log.error("SSD index %s is unreadable (%s): starting the SSD tier empty", path,
                      problem)
            counters["index_resets"] += 1
            shutil.rmtree(path, ignore_errors=True)
            self._open(reserve_bytes)
        elif had_data and not had_index:
            log.warning("SSD index %s is missing: starting the SSD tier empty", path)
            counters["index_resets"] += 1

    def load(self) -> tuple[list[SSDEntry], list[bytes]]:
        """Every decodable entry, and the keys of damaged values."""
        entries: list[SSDEntry] = []
        bad: list[bytes] = []
        with self._lock, self._env.begin(db=self._db) as txn:
            for key, value in txn.cursor():
                entry = decode_entry(bytes(key), bytes(value), self._alignment)
                if entry is None:
                    bad.append(bytes(key))
                else:
                    entries.append(entry)
        return entries, bad

    def delete_keys(self, keys: Iterable[bytes]) -> None:
        with self._lock, self._env.begin(write=True, db=self._db) as txn:
            for key in keys:
                txn.delete(key)

    def note_delete(self, entry: SSDEntry) -> None:
        """Queue the delete of a dropped entry for the next commit, whichever thread makes it."""
        with self._deferred_lock:
            self._deferred.append(entry)

    def commit(self, puts: list[SSDEntry], deletes: list[SSDEntry]) -> bool:
        """One transaction, with every queued delete; a delete only removes the exact entry
        (seq) that was dropped.

        False when LMDB refuses (disk full, IO error): none of it is visible, and the deletes are
        retried with the next commit (until then a restart may find those stale entries; their
        checksums fail).
        """
        with self._lock:
            with self._deferred_lock:
                # Taken inside the transaction lock: a later commit cannot overtake this one
                # without the deletes it carries.
                deletes = list({id(e): e for e in self._deferred + list(deletes)}.values())
                self._deferred = []
            if not puts and not deletes:
                return True
            while True:
                try:
                    with self._env.begin(write=True, db=self._db) as txn:
                        for entry in deletes:
                            value = txn.get(entry.key)
                            old = decode_entry(entry.key, value, self._alignment) if value else None
                            if old is not None and old.seq == entry.seq:
                                txn.delete(entry.key)
                        for entry in puts:
                            txn.put(entry.key, entry.encode())
                    return True
                except lmdb.MapFullError:
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
                except lmdb.Error as exc:
                    log.error("SSD index commit failed: %s", exc)
                    with self._deferred_lock:
                        self._deferred = deletes + self._deferred
                    return False

    def keys(self) -> tuple[set[bytes], set[bytes]]:
        """(every key in LMDB, the keys of deletes still deferred): for integrity checks."""
        with self._lock, self._env.begin(db=self._db) as txn:
            with self._deferred_lock:
                deferred = {e.key for e in self._deferred}
            return {bytes(k) for k, _ in txn.cursor()}, deferred

    def close(self, read_only_reported: bool = False) -> None:
        """Sync and close. A sync that fails (the filesystem went read-only after an error) is
        logged, never raised: every commit made before is as durable as the disk let it be,
        and a stop must not fail over it. ``read_only_reported``: the tier already said the
        filesystem is read-only (then this is no news: logged at info)."""
        with self._lock:
            try:
                self._env.sync(True)
            except lmdb.Error as exc:
                log.log(logging.INFO if read_only_reported else logging.WARNING,
                        "SSD index %s: final sync failed (%s); entries committed before stay "
                        "as the disk kept them", self.path, exc)
            self._env.close()

    def _open(self, reserve_bytes: int) -> None:
        self.path.mkdir(mode=0o700, exist_ok=True)
        data = self.path / "data.mdb"
        size = max(data.stat().st_size if data.exists() else 0, reserve_bytes)
        env = lmdb.open(str(self.path), map_size=max(64 << 20, 2 * size), subdir=True,
                        max_dbs=2, sync=self._durable, metasync=self._durable, readahead=False)
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
        except lmdb.Error:
            env.close()
            raise
        self._env, self._db = env, db
        # After LMDB wrote its meta pages: a longer file is fine for it, a zero-filled new one
        # is not.
        if data.stat().st_size < reserve_bytes:
            fd = os.open(data, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.posix_fallocate(fd, 0, reserve_bytes)
            except OSError as exc:
                log.warning("cannot reserve %d B for the SSD index: %s", reserve_bytes, exc)
            finally:
                os.close(fd)
