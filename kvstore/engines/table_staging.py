"""Pinned host slots for the gather kernel's run tables, read by the kernel in place.

A table (int64 ``[3, num_runs]``) written into page-locked, device-mapped memory needs no
host-to-device copy: each CTA of ``copy_runs`` reads its run's three words over the bus once.
A slot is rewritten only once the event recorded after the launch that read it completed, so
no launch ever reads a table a later submission overwrote. The ring's budget is ``num_slots *
max_table_bytes`` of pinned memory: a larger table is refused (``take`` gives None) and the caller
uploads it instead. Not thread-safe: the copier holds its stream's lock around ``take`` ..
``retire``.
"""

from __future__ import annotations

import numpy as np

_MIN_SLOT_BYTES = 64 << 10
# 1 MiB is 43,690 runs: 1.4 GB of vLLM's 32 KiB pieces in one launch.
MAX_TABLE_BYTES = 1 << 20


class _Slot:
    def __init__(self) -> None:
        self.memory = None  # cupy PinnedMemoryPointer
        self.capacity_bytes = 0
        self.event = None  # recorded after the last launch that read this slot


class PinnedTables:
    """A ring of ``num_slots`` pinned buffers that grow to the largest table asked for, at
    most ``max_table_bytes`` each."""

    def __init__(self, num_slots: int = 16, max_table_bytes: int = MAX_TABLE_BYTES) -> None:
        self._slots = [_Slot() for _ in range(num_slots)]
        self._next = 0
        self.max_table_bytes = max_table_bytes
        self.mapped: bool | None = None  # known after the first allocation

    def take(self, table: np.ndarray) -> tuple[int, _Slot] | None:
        """Copy ``table`` into the next free slot; (device-readable address, slot), or None
        where pinned memory is not mapped at the same address or the table is larger than
        ``max_table_bytes`` (the caller uploads instead)."""
        if table.nbytes > self.max_table_bytes:
            return None
        import cupy as cp

        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.event is not None:
            slot.event.synchronize()  # the launch that read it is done (normally long ago)
            slot.event = None
        if slot.capacity_bytes < table.nbytes:
            size = min(self.max_table_bytes, max(table.nbytes, _MIN_SLOT_BYTES))
            slot.memory, slot.capacity_bytes = cp.cuda.alloc_pinned_memory(size), size
            if self.mapped is None:
                attrs = cp.cuda.runtime.pointerGetAttributes(slot.memory.ptr)
                self.mapped = attrs.devicePointer == slot.memory.ptr
        if not self.mapped:
            return None
        view = np.frombuffer(slot.memory, dtype=np.int64, count=table.size)
        view[:] = table.ravel()
        return slot.memory.ptr, slot

    @staticmethod
    def retire(slot: _Slot, event) -> None:
        """``event`` (recorded after the launch) guards the slot from now on."""
        slot.event = event
