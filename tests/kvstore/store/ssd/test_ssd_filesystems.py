"""The SSD tier on hostile filesystems: one that refuses O_DIRECT, one that is full.

Both need a scratch mount, so they run only as root where ``mount`` works (else skipped).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_helpers import NS, block_bytes, block_key

BLOCK = 16 * 1024


@contextlib.contextmanager
def _mounted(mountpoint: Path, fstype: str, options: str = "") -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a scratch filesystem")
    mountpoint.mkdir()
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype,
                                                                              str(mountpoint)]
    if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
        pytest.skip(f"cannot mount {fstype} here")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


def _put_all(store, indices):
    for i in indices:
        h, ident = block_key(i)
        store.put(NS, h, ident, block_bytes(i, BLOCK))


def test_filesystem_without_o_direct_falls_back_to_buffered(make_store, tmp_path):
    with _mounted(tmp_path / "ramfs", "ramfs") as mnt:
        store = make_store(dram_bytes=8 * BLOCK, ssd_dir=mnt / "ssd", ssd_bytes=64 * BLOCK)
        ssd = store.stats()["tiers"]["ssd"]
        assert ssd["io_mode"] == "buffered" and "refused" in ssd["io_mode_reason"]
        _put_all(store, range(30))
        store.flush_to_ssd()
        store.close()
        store = make_store(dram_bytes=8 * BLOCK, ssd_dir=mnt / "ssd", ssd_bytes=64 * BLOCK)
        for i in range(30):
            h, ident = block_key(i)
            assert store.get(NS, h, ident) == block_bytes(i, BLOCK)
        store.check_integrity()
        store.close()


def test_full_disk_never_fails_a_put_nor_serves_other_bytes(make_store, tmp_path):
    # 1 MiB of disk under a 4 MiB SSD tier: preallocation fails, writes hit ENOSPC.
    with _mounted(tmp_path / "tiny", "tmpfs", "size=1m") as mnt:
        store = make_store(dram_bytes=8 * BLOCK, ssd_dir=mnt / "ssd", ssd_bytes=256 * BLOCK)
        for start in range(0, 100, 10):
            _put_all(store, range(start, start + 10))
            store.flush_to_ssd()
        ssd = store.stats()["tiers"]["ssd"]
        assert ssd["counters"]["sparse_files"] == 1
        assert ssd["counters"]["enospc"] + ssd["counters"]["index_commit_failures"] > 0
        assert ssd["blocks"] > 10  # it keeps serving what fits
        served = 0
        for i in range(100):
            h, ident = block_key(i)
            got = store.get(NS, h, ident)
            assert got is None or got == block_bytes(i, BLOCK)
            served += got is not None
        assert served > 10
        store.check_integrity()
        store.close()
        store = make_store(dram_bytes=8 * BLOCK, ssd_dir=mnt / "ssd", ssd_bytes=256 * BLOCK)
        for i in range(100):
            h, ident = block_key(i)
            got = store.get(NS, h, ident)
            assert got is None or got == block_bytes(i, BLOCK)
        store.check_integrity()
        store.close()
