"""A real ext4 filesystem (a loop-mounted image, ``errors=remount-ro``) that the kernel turns
read-only on demand, exactly as after a disk error: ``trigger_fs_error`` makes ext4 record an
error and remount itself read-only, with files still open for writing. Needs root."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)


@contextmanager
def ext4_mount(workdir: Path, size_mib: int = 64) -> Iterator[Path]:
    """A fresh ext4 of ``size_mib`` mounted at ``workdir/mnt``; skips the test without root."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to mount a loop filesystem")
    image, mnt = workdir / "disk.img", workdir / "mnt"
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    mnt.mkdir()
    made = _run("mkfs.ext4", "-q", "-F", str(image))
    mounted = made.returncode == 0 and _run("mount", "-o", "loop,errors=remount-ro", str(image),
                                            str(mnt)).returncode == 0
    if not mounted:
        pytest.skip(f"cannot loop-mount an ext4 image here: {made.stderr.strip()}")
    try:
        yield mnt
    finally:
        _run("umount", "-l", str(mnt))  # lazy: a killed daemon may still hold files


def make_read_only(mnt: Path) -> None:
    """Make ext4 hit an error: with ``errors=remount-ro`` it turns itself read-only."""
    device = Path(_run("findmnt", "-no", "SOURCE", str(mnt)).stdout.strip()).name
    Path(f"/sys/fs/ext4/{device}/trigger_fs_error").write_text("kvstore test\n")
    probe = mnt / ".probe"
    try:
        probe.write_bytes(b"x")
    except OSError:
        return
    raise AssertionError(f"{mnt} is still writable after the injected ext4 error")


def filesystem_free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
