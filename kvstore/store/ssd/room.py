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
from kvstore.store.ssd.files import ALIGNMENT


class SSDNoRoom(ValueError):
    """The asked SSD capacity does not fit the filesystem; the message has the figures."""


def tier_layout(capacity_bytes: int, max_file_bytes: int) -> tuple[int, int]:
    """(number of data files, bytes per file) of a tier of ``capacity_bytes``."""
    num_files = max(1, -(-capacity_bytes // max(max_file_bytes, ALIGNMENT)))
    return num_files, capacity_bytes // num_files // ALIGNMENT * ALIGNMENT


def index_reserve_bytes(capacity_bytes: int) -> int:
    """Disk taken up front for the LMDB index, so a disk that fills later cannot stop commits."""
    return min(max(capacity_bytes // 2048, 1 << 20), 512 << 20)


def allocated_bytes(path: Path, cap_bytes: int) -> int:
    """Disk space ``path`` holds now (its allocated blocks), at most ``cap_bytes``; 0 if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0
    return min(st.st_blocks * 512, cap_bytes)


def check_room(directory: Path, capacity_bytes: int, max_file_bytes: int) -> None:
    """Raise SSDNoRoom unless a tier of ``capacity_bytes`` under ``directory`` (its data files
    and its index's reserve) fits the free space of the filesystem plus what the tier's files
    there already hold. A filesystem that reports no size (ramfs) is not checked."""
    st = os.statvfs(directory)
    if st.f_blocks == 0:
        return
    num_files, file_bytes = tier_layout(capacity_bytes, max_file_bytes)
    index_bytes = index_reserve_bytes(file_bytes * num_files)
    free_bytes = st.f_bavail * st.f_frsize
    held_bytes = sum(allocated_bytes(directory / f"data-{i:03d}.bin", file_bytes)
                     for i in range(num_files))
    held_bytes += allocated_bytes(directory / "index.lmdb" / "data.mdb", index_bytes)
    data_bytes = file_bytes * num_files
    if data_bytes + index_bytes <= free_bytes + held_bytes:
        return
    raise SSDNoRoom(
        f"SSD tier of {format_bytes(data_bytes)} (+ {format_bytes(index_bytes)} for its index) "
        f"does not fit {directory}: its filesystem has {format_bytes(free_bytes)} free and the "
        f"tier's files there already hold {format_bytes(held_bytes)}, "
        f"{format_bytes(free_bytes + held_bytes)} in all; ask for less (--ssd-size) or free space")
