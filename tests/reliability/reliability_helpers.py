"""Shared bits of the reliability tests: a fault-injecting disk, an in-process daemon, guarded
shared-memory arenas and deterministic blocks. Everything here drives the real components."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import tempfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np
from support.arena import ShmArena

from kvstore.daemon.server import Daemon
from kvstore.daemon.service import Service
from kvstore.keys import Namespace, block_hash, block_ident
from kvstore.store.ssd.files import ALIGNMENT, FileOps
from kvstore.store.tiered import StoreConfig, TieredStore
from kvstore.wire.client import Client

NS = Namespace(name="reliability-tests").digest


def block_bytes(i: int, num_bytes: int) -> bytes:
    """Distinct, reproducible bytes for block ``i`` (any process computes the same)."""
    return np.random.default_rng([11, i]).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()


def block_key(i: int) -> tuple[bytes, bytes]:
    """(block hash, ident) of a one-block chain whose tokens are ``[i] * 16``."""
    tokens = [i] * 16
    return block_hash(NS, tokens), block_ident(NS, tokens)


def put_blocks(store: TieredStore, indices, num_bytes: int) -> None:
    for i in indices:
        h, ident = block_key(i)
        store.put(NS, h, ident, block_bytes(i, num_bytes))


def get_block(store: TieredStore, i: int) -> bytes | None:
    h, ident = block_key(i)
    return store.get(NS, h, ident)


def assert_exact_or_missing(store: TieredStore, indices, num_bytes: int) -> int:
    """Every block is its own bytes or a miss, never other bytes; returns how many were served."""
    served = 0
    for i in indices:
        got = get_block(store, i)
        assert got is None or got == block_bytes(i, num_bytes), f"block {i} has other bytes"
        served += got is not None
    return served


def assert_within_cap(store: TieredStore) -> None:
    """The SSD tier never holds more than its cap: in its accounting nor in its files."""
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["used_bytes"] <= ssd["capacity_bytes"]
    on_disk = sum(p.stat().st_size for p in store.ssd_tier.dir.glob("data-*.bin"))
    assert on_disk <= ssd["capacity_bytes"], f"{on_disk} B of data files over the cap"


# ----------------------------------------------------------------------------- faulty disk


class FaultyDisk(FileOps):
    """The real file calls, failing on demand like a full or broken disk.

    ``free_bytes`` (None: unlimited) models the room left on the disk: preallocation that does
    not fit fails with ENOSPC, and a write needing more fresh pages than are left moves what
    fits (a short write) or fails with ENOSPC, while rewriting pages a file already has costs
    nothing, as on a real filesystem. ``eio_reads`` holds (data file name, offset) pairs whose
    read fails with EIO; ``eio_writes`` and ``eio_sync`` fail every write or fdatasync.
    """

    def __init__(self, free_bytes: int | None = None) -> None:
        self.free_bytes = free_bytes
        self.eio_reads: set[tuple[str, int]] = set()
        self.eio_writes = False
        self.eio_sync = False
        self.calls: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self._backed: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _name(fd: int) -> str:
        return Path(os.readlink(f"/proc/self/fd/{fd}")).name

    def _take_pages(self, fd: int, start: int, end: int, partial: bool) -> int:
        """Back the pages of [start, end); returns the end of the prefix that got room."""
        if self.free_bytes is None:
            return end
        with self._lock:
            backed = self._backed.setdefault(self._name(fd), set())
            fresh = [p for p in range(start // ALIGNMENT, -(-end // ALIGNMENT)) if p not in backed]
            room = self.free_bytes // ALIGNMENT
            if len(fresh) > room and not partial:
                return start
            for page in fresh[:room]:
                backed.add(page)
            self.free_bytes -= min(len(fresh), room) * ALIGNMENT
            return end if len(fresh) <= room else max(start, fresh[room] * ALIGNMENT)

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        self.calls["pwritev"] += 1
        if self.eio_writes:
            self.faults["eio_write"] += 1
            raise OSError(errno.EIO, "injected write error")
        (buf,) = buffers
        buf = memoryview(buf)
        fits = self._take_pages(fd, offset, offset + buf.nbytes, partial=True) - offset
        if fits <= 0:
            self.faults["enospc"] += 1
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        if fits < buf.nbytes:
            self.faults["short_write"] += 1
            buf = buf[:fits]
        return os.pwritev(fd, [buf], offset)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        self.calls["preadv"] += 1
        if (self._name(fd), offset) in self.eio_reads:
            self.faults["eio_read"] += 1
            raise OSError(errno.EIO, "injected read error")
        return os.preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        self.calls["fdatasync"] += 1
        if self.eio_sync:
            self.faults["eio_sync"] += 1
            raise OSError(errno.EIO, "injected fdatasync error")
        os.fdatasync(fd)

    def posix_fallocate(self, fd: int, offset: int, length: int) -> None:
        self.calls["posix_fallocate"] += 1
        if self._take_pages(fd, offset, offset + length, partial=False) < offset + length:
            self.faults["enospc"] += 1
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        os.posix_fallocate(fd, offset, length)


# -------------------------------------------------------------------------- in-process daemon


class InProcessDaemon:
    """The real Daemon, Service and TieredStore on a background thread of this process, so a
    test can call ``store.check_integrity()`` while clients (threads or processes) talk to it."""

    def __init__(self, config: StoreConfig, **daemon_kwargs) -> None:
        self.store = TieredStore(config)
        self.service = Service(self.store)
        self.socket_path = Path(tempfile.mkdtemp(prefix="kvr-")) / "kvstore.sock"
        self.daemon = Daemon(self.service, self.socket_path, flush_on_exit=False,
                             **daemon_kwargs)
        ready = threading.Event()
        self._error: BaseException | None = None

        def run() -> None:
            try:
                asyncio.run(self.daemon.serve(on_ready=ready.set))
            except BaseException as exc:  # surfaced by stop()
                self._error = exc
                ready.set()

        self._thread = threading.Thread(target=run, name="kvr-daemon", daemon=True)
        self._thread.start()
        assert ready.wait(20), "in-process daemon did not start"
        if self._error is not None:
            raise self._error

    def client(self, **kwargs) -> Client:
        return Client(self.socket_path, **kwargs)

    def stop(self) -> None:
        self.daemon.stop()
        self._thread.join(30)
        shutil.rmtree(self.socket_path.parent, ignore_errors=True)
        assert not self._thread.is_alive(), "in-process daemon did not stop"
        if self._error is not None:
            raise self._error


# ------------------------------------------------------------------------ guarded KV arenas


GUARD_BYTES = 4096


def guarded_arena(num_blocks: int, block_bytes: int, seed: int | None) -> ShmArena:
    """An engine's KV arena in POSIX shared memory: ``num_blocks`` blocks between two guards.

    The registered region starts after the first guard and ends before the second, which lies
    outside it altogether: a copy to or from a block id outside the arena would hit a guard.
    """
    return ShmArena(num_blocks, block_bytes, seed, guard_bytes=GUARD_BYTES)
