"""The SSD directory's lock: one process at a time, held by an OS lock for its lifetime.

The lock is ``flock`` on an open descriptor of the directory itself, not on a file in it: a
``LOCK`` file can be deleted while its holder runs, and a second process would then create and
lock a fresh one (two daemons writing the same data files). The directory cannot be unlinked
while it holds the data, so its lock cannot be sidestepped that way. ``LOCK`` still gets the
holder's pid, for people; the refusal names the holder from ``/proc/locks``, which the kernel
keeps true even when ``LOCK`` is gone or stale.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

PID_FILE = "LOCK"


class DirectoryBusy(OSError):
    """Another process holds the directory; the message names it (pid) when it can."""

    def __str__(self) -> str:
        return str(self.strerror)


def lock_holder_pid(fd: int) -> int | None:
    """The pid holding a flock on the file open at ``fd`` (from /proc/locks), or None."""
    st = os.fstat(fd)
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            for line in locks:
                fields = line.split()
                # "N: FLOCK ADVISORY WRITE <pid> <maj:min:inode> 0 EOF"; "->" marks waiters.
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
                    return int(fields[4])
    except (OSError, ValueError):
        return None
    return None


def _pid_from_file(directory: Path) -> int | None:
    try:
        text = (directory / PID_FILE).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


class DirLock:
    """An exclusive lock on ``directory``, taken at construction, dropped by ``close()``.

    Raises DirectoryBusy (errno EBUSY) when another process holds it.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = lock_holder_pid(self._fd) or _pid_from_file(directory)
            os.close(self._fd)
            who = f"pid {holder}" if holder is not None else "another process"
            raise DirectoryBusy(errno.EBUSY, f"SSD directory {directory} is in use by {who} "
                                             "(a kvstore daemon holds its lock)") from None
        try:  # for people only: the lock above is what counts
            tmp = directory / f".{PID_FILE}.{os.getpid()}"
            tmp.write_text(f"{os.getpid()}\n", encoding="ascii")
            os.replace(tmp, directory / PID_FILE)
        except OSError:
            pass  # a read-only or full disk: the lock holds all the same

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1
