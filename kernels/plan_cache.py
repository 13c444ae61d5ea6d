"""Built cuDNN graphs kept on disk between starts: a build costs 42 ms to 1.2 s (cuDNN compiles
its fused kernels at run time), loading a serialized plan 4-14 ms (one H200, 2026-11-29: the
``first_use_builds`` of ``benchmarks/results/multiturn-agent-tools-h200-*-2026-11-29.json``).

A serialized plan carries compiled kernels that are loaded as native code, so the cache trusts
nothing it did not write itself into a directory only this user can write:

- the directory is created 0700; one owned by another user, or writable by group or others, is
  not used (logged once; every plan is then built, as without a cache);
- each entry is ``MAGIC | sha256(blob) | blob``; a short, foreign or mismatching file is deleted
  and counted as ``corrupt`` (the plan is built again), never loaded;
- entries are written to a temporary file and renamed into place (a crash leaves no half file);
- the directory holds at most ``max_entries`` plans: the least recently used go first.

Entries are named by a digest of everything the plan depends on (the caller's key plus the cuDNN
versions and the device): a plan is never loaded into another setup. ``KVSTORE_CUDNN_PLAN_CACHE``
names the directory (default ``~/.cache/kvstore/cudnn-plans``), or ``off``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import tempfile
import threading
from collections import Counter
from pathlib import Path

log = logging.getLogger("kernels.plan_cache")

MAGIC = b"KVSTORE-CUDNN-PLAN-1\n"
_DIGEST = 32
MAX_ENTRIES = 2048  # ~100 KB each
ENV = "KVSTORE_CUDNN_PLAN_CACHE"


def default_directory() -> Path | None:
    """The directory ``KVSTORE_CUDNN_PLAN_CACHE`` names, its default, or None (``off``)."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "0", "none"):
        return None
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "kvstore" / "cudnn-plans"


class PlanCache:
    """Serialized plans by name on disk; every method is safe to call from any thread and never
    raises for a disk problem (a failed read is a miss, a failed write is counted)."""

    def __init__(self, directory: Path | None, max_entries: int = MAX_ENTRIES) -> None:
        # hit, miss, corrupt, stored, write_failed, evicted; the caller's unloadable, unserializable
        self.counts: Counter[str] = Counter()
        self.max_entries = max_entries
        self._lock = threading.Lock()
        # why the cache is off ("" while it is on)
        self.reason = f"{ENV}=off" if directory is None else _usable(directory)
        if self.reason and directory is not None:
            log.warning("cuDNN plan cache off: %s", self.reason)
        self.directory = None if self.reason else directory

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    @staticmethod
    def name(*parts: object) -> str:
        """The entry name of a plan that depends on ``parts`` (reprs, hashed)."""
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]

    def get(self, name: str) -> bytes | None:
        """The blob stored under ``name``, verified; None when absent, unreadable or corrupt."""
        if self.directory is None:
            return None
        path = self.directory / name
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.count("miss")
            return None
        except OSError as exc:
            log.warning("cuDNN plan cache: cannot read %s: %s", path, exc)
            self.count("miss")
            return None
        head = len(MAGIC) + _DIGEST
        blob = data[head:]
        if len(data) <= head or not data.startswith(MAGIC) or \
                hashlib.sha256(blob).digest() != data[len(MAGIC):head]:
            log.warning("cuDNN plan cache: %s is damaged; it is deleted and the plan rebuilt",
                        path)
            self.count("corrupt")
            self._unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        self.count("hit")
        return blob

    def put(self, name: str, blob: bytes) -> bool:
        """Store ``blob`` under ``name`` (atomically); False if it could not be written."""
        if self.directory is None:
            return False
        data = MAGIC + hashlib.sha256(blob).digest() + bytes(blob)
        try:
            write_atomically(self.directory / name, data)
        except OSError as exc:  # a full disk, a removed directory: the plan still serves
            log.warning("cuDNN plan cache: cannot write %s: %s", name, exc)
            self.count("write_failed")
            return False
        self.count("stored")
        self._trim()
        return True

    def _trim(self) -> None:
        try:
            entries = [e for e in os.scandir(self.directory)
                       if e.is_file(follow_symlinks=False) and not e.name.startswith(".")]
        except OSError:
            return
        extra = len(entries) - self.max_entries
        if extra <= 0:
            return
        entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime)
        for entry in entries[:extra]:
            self._unlink(Path(entry.path))
            self.count("evicted")

    def count(self, what: str) -> None:
        """Count an outcome (also the caller's: a blob cuDNN could not load or write)."""
        with self._lock:
            self.counts[what] += 1

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file renamed into place (a crash leaves no
    half file; a dot name the cache never trims); OSError if it could not be written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _usable(directory: Path) -> str:
    """'' when ``directory`` exists (created 0700 if missing), is ours and no one else's to
    write; else why not."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(directory, follow_symlinks=False)
    except OSError as exc:
        return f"cannot create {directory}: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid != os.getuid():
        return f"{directory} belongs to uid {st.st_uid}, not this user"
    if st.st_mode & 0o022:
        return f"{directory} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return ""
