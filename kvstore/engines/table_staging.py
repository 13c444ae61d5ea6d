"""Pinned host slots for the gather kernel's run tables, read by the kernel in place.

A table (int64 ``[3, num_runs]``) written into page-locked, device-mapped memory needs no
host-to-device copy: each CTA of ``copy_runs`` reads its run's three words over the bus once.
A slot is rewritten only once the event recorded after the launch that read it completed, so
no launch ever reads a table a later submission overwrote. Not thread-safe: the copier holds
its stream's lock around ``take`` .. ``retire``.
"""

from __future__ import annotations

import numpy as np


class _Slot:
    def __init__(self) -> None:
        self.memory = None  # cupy PinnedMemoryPointer
        self.capacity_bytes = 0
        self.event = None  # recorded after the last launch that read this slot


class PinnedTables:
    """A ring of ``num_slots`` pinned buffers that grow to the largest table asked for."""

    def __init__(self, num_slots: int = 16) -> None:
        self._slots = [_Slot() for _ in range(num_slots)]
        self._next = 0
        self.mapped: bool | None = None  # known after the first allocation

    def take(self, table: np.ndarray) -> tuple[int, _Slot] | None:
        """Copy ``table`` into the next free slot; (device-readable address, slot), or None
        where pinned memory is not mapped at the same address (the caller uploads instead)."""
        import cupy as cp

        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.event is not None:
            slot.event.synchronize()  # the launch that read it is done (normally long ago)
            slot.event = None
        if slot.capacity_bytes < table.nbytes:
            size = max(table.nbytes, 64 << 10)
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
