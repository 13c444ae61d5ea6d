"""Anonymous shared memory an engine shares with the daemon by file descriptor, never by name.

``AnonymousMemory`` is a ``memfd``: nothing in /dev/shm another process could open by name. It is
sized once and sealed (no shrinking, no growing, no more seals): the daemon refuses memory that
could shrink under its copies. ``fd`` goes into ``KVLayout.fds``, and the register frame carries
it to the daemon (``SCM_RIGHTS``), which maps its own copy: that descriptor is the registration's
proof that the engine holds the memory. Closing drops this process's descriptor and mapping (the
mapping once no view holds it); a daemon that mapped the memory keeps it until it unregisters.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import weakref

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _release(mapping: mmap.mmap, buf: memoryview, fd_box: list[int]) -> None:
    # BufferError: an array still views the memory; the mapping goes when the last one does.
    with contextlib.suppress(BufferError):
        buf.release()
    with contextlib.suppress(BufferError):
        mapping.close()
    _close_fd(fd_box)


def _close_fd(fd_box: list[int]) -> None:
    if fd_box:
        with contextlib.suppress(OSError):
            os.close(fd_box.pop())


class AnonymousMemory:
    """``size_bytes`` of zeroed shared memory named ``name`` only in /proc (``memfd:NAME``)."""

    def __init__(self, size_bytes: int, name: str) -> None:
        if size_bytes <= 0:
            raise ValueError("anonymous memory needs a positive size")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mapping = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.size_bytes = size_bytes
        self.buf = memoryview(mapping)
        self._fd_box = [fd]  # emptied once the descriptor is closed
        self._finalizer = weakref.finalize(self, _release, mapping, self.buf, self._fd_box)

    @property
    def fd(self) -> int:
        """This process's descriptor of the memory; ValueError once it was closed."""
        if not self._fd_box:
            raise ValueError("the memory's file descriptor was closed")
        return self._fd_box[0]

    def close_fd(self) -> None:
        """Drop the descriptor, keep the mapping (nothing more to register). Idempotent."""
        _close_fd(self._fd_box)

    def close(self) -> None:
        """Drop the descriptor and the mapping (once no view holds it). Idempotent."""
        self._finalizer()
