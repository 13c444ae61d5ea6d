"""Device staging for batches of small runs: gather on the GPU, cross the bus in whole blocks.

vLLM's layout cuts a 2.36 MB block into 72 pieces of 32 KiB. The copy engines pay a few
microseconds per piece and a kernel reading or writing mapped host memory reaches ~80-86% of the
bus (H100, 2026-11-25), so a batch of pieces goes through a device buffer instead: a save gathers
the pieces into it with ``copy_runs`` (HBM to HBM, ~25 us for a 32 MB chunk), then the copy
engine moves it to the pool in one run per block (the pieces of a block are contiguous in both
places, so ``coalesce_arrays`` merges them); a load does the reverse. The kernel runs on a stream
of its own, ordered against the copy stream by events on the GPU, so the next chunk's gather
overlaps this chunk's transfer. Buffers come from a small ring; a buffer is reused only after the
event of the batch that last used it (waited on the GPU, never by the CPU, except to grow it).
The ring's budget is ``num_slots * max_slot_bytes`` of HBM on the engine's device: a larger batch
goes through in parts (``staged_parts``), a run larger than a slot never comes here.
Not thread-safe: the copier holds its stream's lock.
"""

from __future__ import annotations

import numpy as np

from kvstore.engines.copy_settings import DEFAULT_STAGING_SLOT_BYTES
from kvstore.engines.run_arrays import RunArrays, coalesce_arrays

_MIN_SLOT_BYTES = 8 << 20


class _Slot:
    def __init__(self) -> None:
        self.memory = None  # cupy.cuda.Memory (a cudaMalloc of its own)
        self.capacity_bytes = 0
        self.event = None  # recorded after the last batch that used this buffer


class DeviceStaging:
    """A ring of ``num_slots`` device buffers that grow to the largest batch asked for, at
    most ``max_slot_bytes`` each."""

    def __init__(self, num_slots: int = 4,
                 max_slot_bytes: int = DEFAULT_STAGING_SLOT_BYTES) -> None:
        self._slots = [_Slot() for _ in range(num_slots)]
        self._next = 0
        self.max_slot_bytes = max_slot_bytes

    def take(self, num_bytes: int) -> _Slot:
        """The next buffer, at least ``num_bytes``; its ``event`` (if any) must be waited on
        (on the GPU) before it is written. ValueError past ``max_slot_bytes``."""
        if num_bytes > self.max_slot_bytes:
            raise ValueError(f"a staged batch of {num_bytes} bytes exceeds a staging slot "
                             f"({self.max_slot_bytes} bytes): cut it with staged_parts")
        import cupy as cp

        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.capacity_bytes < num_bytes:
            if slot.event is not None:
                slot.event.synchronize()  # the old buffer is idle before it is freed
                slot.event = None
            size = min(self.max_slot_bytes, max(num_bytes, _MIN_SLOT_BYTES))
            slot.memory, slot.capacity_bytes = None, 0
            slot.memory, slot.capacity_bytes = cp.cuda.Memory(size), size
        return slot


def staged_sides(runs: RunArrays, base_ptr: int, to_device: bool) -> tuple[RunArrays,
                                                                           RunArrays]:
    """(bus runs, device runs) of a staged batch placed at ``base_ptr``: the runs packed back
    to back in batch order. Save: device runs gather (engine -> staging), bus runs carry the
    staging to the host. Load: bus runs carry the host into staging, device runs scatter it."""
    offsets = np.cumsum(runs.num_bytes) - runs.num_bytes
    staged = base_ptr + offsets
    if to_device:
        return (coalesce_arrays(RunArrays(runs.src_ptrs, staged, runs.num_bytes)),
                RunArrays(staged, runs.dst_ptrs, runs.num_bytes))
    return (coalesce_arrays(RunArrays(staged, runs.dst_ptrs, runs.num_bytes)),
            RunArrays(runs.src_ptrs, staged, runs.num_bytes))


def staged_parts(runs: RunArrays, max_bytes: int) -> list[RunArrays]:
    """``runs`` cut, in order, into consecutive parts of at most ``max_bytes`` each (one staging
    slot each); ValueError if a single run is larger than ``max_bytes``."""
    if len(runs) and int(runs.num_bytes.max()) > max_bytes:
        raise ValueError(f"a run of {int(runs.num_bytes.max())} bytes exceeds a staging slot "
                         f"({max_bytes} bytes)")
    ends = np.cumsum(runs.num_bytes)
    parts, start, base = [], 0, 0
    while start < len(runs):
        # the last run ending within max_bytes of this part's start; at least runs[start]
        stop = int(np.searchsorted(ends, base + max_bytes, side="right"))
        parts.append(RunArrays(runs.src_ptrs[start:stop], runs.dst_ptrs[start:stop],
                               runs.num_bytes[start:stop], coalesced=runs.coalesced))
        base, start = int(ends[stop - 1]), stop
    return parts
