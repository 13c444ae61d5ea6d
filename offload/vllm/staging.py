"""A shared-memory staging buffer: the CPU path's way into vLLM's KV tensors.

The daemon's CPU path maps shared-memory segments by name; vLLM allocates its CPU KV tensors in
ordinary process memory, which no other process can map. So the worker registers a segment of
``num_slots`` whole blocks (block-major, one region) and copies between it and vLLM's tensors:
saves copy vLLM -> slots before the daemon reads them, loads copy slots -> vLLM after the daemon
wrote them. Slots are handed out and given back explicitly; a buffer whose connection was lost is
abandoned whole (unlinked at once, freed once no job holds it), so a daemon that wakes up late
can only ever write into memory nobody reads. The segment's name is removed as soon as the daemon
has mapped it (``unlink``), so nothing is left in /dev/shm whichever process dies.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

import numpy as np

from kvstore.layout import KVLayout, Region

_SHM_DIR = "/dev/shm"


class StagingBuffer:
    """``num_slots`` blocks of ``block_bytes`` in a fresh POSIX shared-memory segment."""

    def __init__(self, num_slots: int, block_bytes: int, prefix: str = "kvs-vllm") -> None:
        if num_slots <= 0 or block_bytes <= 0:
            raise ValueError("a staging buffer needs positive num_slots and block_bytes")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(_SHM_DIR, self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, num_slots * block_bytes)
            self._map = mmap.mmap(fd, num_slots * block_bytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.slots = np.frombuffer(self._map, dtype=np.uint8).reshape(num_slots, block_bytes)
        self._free = list(range(num_slots - 1, -1, -1))
        self._linked = True

    def layout(self, dtype: str, meta: dict) -> KVLayout:
        """The registration: one region, slot ``i`` at ``i * block_bytes``."""
        size = self.num_slots * self.block_bytes
        region = Region(handle=self.name, size_bytes=size, offset=0,
                        block_stride=self.block_bytes, block_bytes=self.block_bytes)
        return KVLayout(num_blocks=self.num_slots, regions=(region,), device="cpu",
                        dtype=dtype, meta=meta)

    @property
    def num_free(self) -> int:
        """Slots not lent to a transfer (the contract tests check slots come back)."""
        return len(self._free)

    def take(self, num_slots: int) -> list[int] | None:
        """``num_slots`` free slots, or None when fewer are free (nothing taken)."""
        if num_slots > len(self._free):
            return None
        return [self._free.pop() for _ in range(num_slots)]

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def unlink(self) -> None:
        """Remove the name (the daemon keeps its mapping until it unregisters); idempotent."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_SHM_DIR, self.name))
