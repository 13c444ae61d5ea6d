"""The SSD tier's data files: preallocated to the size cap, read and written with O_DIRECT.

O_DIRECT is probed at open (an aligned read through an O_DIRECT descriptor); a filesystem that
refuses it with EINVAL (tmpfs before Linux 6.6, ramfs, some FUSE mounts) gets buffered IO plus
fdatasync, and the chosen mode and its reason are reported. A buffer that is not aligned goes
through an aligned bounce buffer. Thread-safe: positional IO only, no shared file offsets.

Every call that moves or reserves data goes through a ``FileOps`` object: the default is the
``os`` module's; the reliability tests pass one that fails like a full or broken disk (ENOSPC,
EIO, short writes), so the real error paths run without root or a scratch mount.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections import Counter
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

ALIGNMENT = 4096
IO_MODES = ("auto", "direct", "buffered")
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class ShortIO(OSError):
    """A read or write that moved fewer bytes than asked (truncated file, full disk)."""


class FileOps:
    """The positional IO, sync and preallocation calls of the data files, as in ``os``.

    One object so that a test can substitute calls that fail; production uses ``OS_FILE_OPS``.
    """

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def posix_fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)


OS_FILE_OPS = FileOps()


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def data_file_path(directory: Path, index: int) -> Path:
    """Where the SSD tier keeps its data file ``index``."""
    return directory / f"data-{index:03d}.bin"


class DataFiles:
    """``num_files`` files of ``file_bytes`` each under ``directory``, named data-NNN.bin.

    ``valid_bytes[i]`` is how much of file ``i`` existed at open: data past it was lost (the file
    was truncated or deleted), whatever the index says. ``ops`` makes the IO calls.
    """

    def __init__(self, directory: Path, num_files: int, file_bytes: int, io_mode: str,
                 counters: Counter[str], ops: FileOps = OS_FILE_OPS) -> None:
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {IO_MODES}, got {io_mode!r}")
        self.file_bytes = file_bytes
        self._ops = ops
        self._counters = counters
        self._lock = threading.Lock()
        self.paths = [data_file_path(directory, i) for i in range(num_files)]
        self.valid_bytes: list[int] = []
        self._fds: list[int] = []  # buffered: fdatasync, and all IO in buffered mode
        for path in self.paths:
            fd, valid = self._open(path)
            self._fds.append(fd)
            self.valid_bytes.append(valid)
        for path in directory.glob("data-*.bin"):  # left over from a larger layout
            stem = path.stem.removeprefix("data-")
            if stem.isdigit() and int(stem) >= num_files:
                path.unlink(missing_ok=True)
        self._direct_fds: list[int] = []
        self.io_mode, self.io_mode_reason = self._choose_io_mode(io_mode)

    def write(self, file_idx: int, offset: int, reserved_bytes: int, data: memoryview,
              num_bytes: int) -> None:
        """Write ``data[:num_bytes]`` at ``offset``; ``data`` may carry padding to the reserve.

        Raises OSError; a short write (full disk) is ShortIO with errno ENOSPC.
        """
        if self.io_mode == "direct":
            if len(data) >= reserved_bytes and _address(data) % ALIGNMENT == 0:
                src = data[:reserved_bytes]
            else:
                bounce = mmap.mmap(-1, reserved_bytes)
                bounce[:num_bytes] = data[:num_bytes]
                src = memoryview(bounce)
            try:
                n = self._ops.pwritev(self._direct_fds[file_idx], [src], offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._fall_back_to_buffered(f"O_DIRECT write failed: {exc.strerror}")
                return self.write(file_idx, offset, reserved_bytes, data, num_bytes)
            if n != len(src):  # a regular file stops short when the disk is full
                raise ShortIO(errno.ENOSPC, f"short O_DIRECT write ({n} of {len(src)} B)")
            return None
        view = data[:num_bytes]
        done = 0
        while done < num_bytes:
            n = self._ops.pwritev(self._fds[file_idx], [view[done:]], offset + done)
            if n <= 0:
                raise ShortIO(errno.ENOSPC, "write made no progress")
            done += n
        return None

    def read(self, file_idx: int, offset: int, reserved_bytes: int, num_bytes: int,
             dest: memoryview) -> None:
        """Fill ``dest[:num_bytes]``; ``dest`` may be longer (padding lets O_DIRECT read in place).

        Raises ShortIO when the file ends early, OSError on IO errors.
        """
        if self.io_mode == "direct":
            if len(dest) >= reserved_bytes and _address(dest) % ALIGNMENT == 0:
                self._read_direct(file_idx, dest[:reserved_bytes], offset)
            else:
                bounce = mmap.mmap(-1, reserved_bytes)
                self._read_direct(file_idx, memoryview(bounce), offset)
                dest[:num_bytes] = bounce[:num_bytes]
            return
        done = 0
        while done < num_bytes:
            got = self._ops.preadv(self._fds[file_idx], [dest[done:num_bytes]], offset + done)
            if got <= 0:
                raise ShortIO(errno.EIO, f"short read at {offset + done} of {self.paths[file_idx]}")
            done += got

    def sync(self, file_idx: int) -> None:
        """fdatasync: the bytes written so far survive a crash or power loss."""
        self._ops.fdatasync(self._fds[file_idx])

    def close(self) -> None:
        for fd in self._direct_fds + self._fds:
            os.close(fd)
        self._direct_fds, self._fds = [], []

    def _read_direct(self, file_idx: int, buf: memoryview, offset: int) -> None:
        try:
            got = self._ops.preadv(self._direct_fds[file_idx], [buf], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or self.io_mode != "direct":
                raise
            self._fall_back_to_buffered(f"O_DIRECT read failed: {exc.strerror}")
            got = self._ops.preadv(self._fds[file_idx], [buf], offset)
        if got != len(buf):
            raise ShortIO(errno.EIO, f"short read ({got} of {len(buf)} B)")

    def _open(self, path: Path) -> tuple[int, int]:
        existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        size = os.fstat(fd).st_size
        if size > self.file_bytes:
            os.ftruncate(fd, self.file_bytes)
        elif size < self.file_bytes:
            try:
                self._ops.posix_fallocate(fd, 0, self.file_bytes)
            except OSError as exc:  # no fallocate here, or not enough room: sparse, ENOSPC later
                log.warning("cannot preallocate %s (%s): using a sparse file", path, exc)
                self._counters["sparse_files"] += 1
                os.ftruncate(fd, self.file_bytes)
        return fd, (min(size, self.file_bytes) if existed else 0)

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
            for path in self.paths:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | _O_DIRECT)
                opened.append(fd)
                self._ops.preadv(fd, [memoryview(probe)], 0)  # EINVAL: IO itself refused
        except OSError as exc:
            for fd in opened:
                os.close(fd)
            if requested == "direct" or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            return "buffered", f"O_DIRECT refused by the filesystem ({exc.strerror})"
        self._direct_fds = opened
        return "direct", "O_DIRECT accepted by the filesystem"

    def _fall_back_to_buffered(self, reason: str) -> None:
        # The O_DIRECT descriptors stay open until close(): another thread may be using one.
        with self._lock:
            if self.io_mode == "direct":
                log.warning("SSD tier falls back to buffered IO: %s", reason)
                self.io_mode, self.io_mode_reason = "buffered", reason
                self._counters["direct_io_fallbacks"] += 1
