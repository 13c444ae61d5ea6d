"""Giving freed memory back to the system (glibc), so RSS falls when big buffers are dropped.

glibc serves large allocations with mmap only above a threshold that grows to the largest
block freed so far; after a burst of 8 MiB replies, later ones come from the heap and their
pages stay with the process after ``free``. Fixing the threshold keeps every large buffer an
mmap of its own (unmapped at free); ``trim`` returns what the heap still holds. Elsewhere than
glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvstore.daemon.memory")

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def use_mmap_for_large_buffers(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Allocations of ``threshold_bytes`` or more get their own mapping; True if set."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold_bytes)))


def trim() -> None:
    """Return the heap's free pages to the system (after connections holding much closed)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(ctypes.c_size_t(0))
