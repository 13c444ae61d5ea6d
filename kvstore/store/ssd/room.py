"""Whether the SSD tier asked for fits its filesystem, checked before a byte is allocated.

A tier larger than the free space used to start anyway: the data files became sparse and the
disk filled later, turning every demotion into an ENOSPC failure and an eviction. The tier is
refused at start instead, with the numbers: what the filesystem has free, what the tier's own
files already hold there (a restart reuses them), and what was asked.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.sizes import format_bytes


class SSDNoRoom(ValueError):
    """The asked SSD capacity does not fit the filesystem; the message has the figures."""


def allocated_bytes(path: Path, cap_bytes: int) -> int:
    """Disk space ``path`` holds now (its allocated blocks), at most ``cap_bytes``; 0 if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0
    return min(st.st_blocks * 512, cap_bytes)


def check_room(directory: Path, data_paths: list[Path], file_bytes: int, index_path: Path,
               index_bytes: int) -> None:
    """Raise SSDNoRoom unless the data files (``file_bytes`` each) and the index's reserve fit
    in the free space of ``directory``'s filesystem plus what those files already hold."""
    st = os.statvfs(directory)
    free_bytes = st.f_bavail * st.f_frsize
    held_bytes = sum(allocated_bytes(p, file_bytes) for p in data_paths)
    held_bytes += allocated_bytes(index_path, index_bytes)
    data_bytes = file_bytes * len(data_paths)
    needed_bytes = data_bytes + index_bytes
    if needed_bytes <= free_bytes + held_bytes:
        return
    raise SSDNoRoom(
        f"SSD tier of {format_bytes(data_bytes)} (+ {format_bytes(index_bytes)} for its index) "
        f"does not fit {directory}: its filesystem has {format_bytes(free_bytes)} free and the "
        f"tier's files there already hold {format_bytes(held_bytes)}, "
        f"{format_bytes(free_bytes + held_bytes)} in all; ask for less (--ssd-size) or free space")
