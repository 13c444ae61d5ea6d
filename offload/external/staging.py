"""A shared-memory staging buffer: the CPU path's way into a hosting engine's KV tensors.

The daemon's CPU path maps memory an engine sends it by file descriptor; an engine like vLLM
allocates its CPU KV tensors in ordinary process memory, which no other process can map. So the
worker registers a buffer of ``num_slots`` whole blocks (block-major, one region) in anonymous
shared memory (a memfd: nothing in /dev/shm) and copies between it and the engine's tensors:
saves copy engine -> slots before the daemon reads them, loads copy slots -> engine after the
daemon wrote them. Slots are
handed out and given back explicitly; a buffer whose connection was lost is abandoned whole
(freed once no job holds it) and the next connection registers a fresh one, so a daemon that
wakes up late can only ever write into memory nobody reads. The buffer's descriptor is dropped
as soon as the daemon has mapped it (``drop_fd``): no descriptor is kept that nothing needs.
"""

from __future__ import annotations

import numpy as np

from kvstore.layout import KVLayout, Region
from offload.anon_memory import AnonymousMemory
from offload.external.slot_pool import SlotPool


class StagingBuffer:
    """``num_slots`` blocks of ``block_bytes`` in fresh anonymous shared memory."""

    def __init__(self, num_slots: int, block_bytes: int, name: str = "kvs-staging") -> None:
        if num_slots <= 0 or block_bytes <= 0:
            raise ValueError("a staging buffer needs positive num_slots and block_bytes")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.memory = AnonymousMemory(num_slots * block_bytes, name)
        self.slots = np.frombuffer(self.memory.buf, dtype=np.uint8).reshape(num_slots,
                                                                            block_bytes)
        self.pool = SlotPool(num_slots)

    def layout(self, dtype: str, meta: dict) -> KVLayout:
        """The registration: one region, slot ``i`` at ``i * block_bytes``, in the memory of
        the registration's file descriptor 0 (this buffer's, until ``drop_fd``)."""
        size = self.num_slots * self.block_bytes
        region = Region(handle=0, size_bytes=size, offset=0,
                        block_stride=self.block_bytes, block_bytes=self.block_bytes)
        return KVLayout(num_blocks=self.num_slots, regions=(region,), device="cpu",
                        dtype=dtype, meta=meta, fds=(self.memory.fd,))

    @property
    def num_free(self) -> int:
        """Slots not lent to a transfer (the contract tests check slots come back)."""
        return self.pool.num_free

    def take(self, num_slots: int) -> list[int] | None:
        """``num_slots`` free slots, or None when fewer are free (nothing taken)."""
        return self.pool.take(num_slots)

    def give_back(self, slots: list[int]) -> None:
        self.pool.give_back(slots)

    def drop_fd(self) -> None:
        """Close this process's descriptor (the daemon keeps its mapping until it unregisters;
        the slots stay usable here); idempotent."""
        self.memory.close_fd()
