"""Which live registration holds which engine host memory: each memory is registered once.

A file descriptor proves its sender holds the memory, but a process of the same uid may open
another engine's memfd through ``/proc/PID/fd`` and send that. So the daemon keys host memory by
its identity (device and inode of the descriptor) and lets one live registration hold each: a
second registration of memory a live registration holds is refused, from any connection, until
the first is closed. (CUDA IPC handles follow the same rule in ``cuda_registration.IpcTable``.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from kvstore.engines.registration import RegistryError

MemoryKey = tuple[int, int]  # (st_dev, st_ino)


def memory_key(fd: int, what: str) -> MemoryKey:
    """The identity of the memory behind received descriptor ``fd``."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise RegistryError("bad_request", f"{what}: unusable file descriptor: {exc}") from None
    return st.st_dev, st.st_ino


class MemoryClaims:
    """Memory keys held by registrations (by id); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: dict[MemoryKey, int] = {}

    def claim(self, keys: Iterable[tuple[MemoryKey, str]], registration_id: int) -> None:
        """Hold every key for ``registration_id``, or none: RegistryError(permission_denied)
        naming the first (``what`` of it) another registration holds."""
        keys = list(keys)
        with self._lock:
            for key, what in keys:
                holder = self._holder.get(key)
                if holder is not None and holder != registration_id:
                    raise RegistryError(
                        "permission_denied", f"{what}: its memory is registered already, and "
                        "memory is registered once while that registration lives (its "
                        "engine's connection owns it)")
            for key, _ in keys:
                self._holder[key] = registration_id

    def release(self, registration_id: int) -> None:
        """Give back every key ``registration_id`` holds."""
        with self._lock:
            for key in [k for k, holder in self._holder.items() if holder == registration_id]:
                del self._holder[key]
