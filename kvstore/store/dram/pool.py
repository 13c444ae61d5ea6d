"""The DRAM tier's memory: one host buffer allocated at start, carved by an offset allocator.

The buffer is one anonymous mapping (page aligned, so every aligned allocation is also fit for
O_DIRECT), faulted in and, when CuPy sees a GPU, page-locked with ``cudaHostRegister`` in chunks
(the pool split among the start-up threads, at most 64 GiB each: ``page_lock.py``), so the copy
engines can DMA straight from it; otherwise it stays plain memory and the CPU path behaves the
same.

A copy whose host range spans two chunks fails (``cudaErrorInvalidValue``, every method that
crosses the bus: measured on an H200 with a 96 GiB pool), and the copier merges runs that
continue each other in memory. So the last alignment unit before every chunk boundary is a fence
the allocator never hands out: no allocation crosses a boundary and no two allocations touch
across one, whether or not the pool is pinned. ``spans()`` are the chunks, the ranges a single
copy may cover. Not thread-safe: the tiered store serialises calls under its lock; only
``view`` results are used outside it (while the block they belong to is pinned).
"""

from __future__ import annotations

import ctypes
import logging
import mmap

from kvstore.sizes import format_bytes
from kvstore.store.allocator import Allocation, OffsetAllocator
from kvstore.store.dram.page_lock import (
    PIN_CHUNK_BYTES,
    NoGpu,
    default_workers,
    fault_in,
    map_anonymous,
    page_lock,
    page_unlock,
    shares,
)

log = logging.getLogger(__name__)

__all__ = ["PIN_CHUNK_BYTES", "Allocation", "HostPool", "PinError"]


class PinError(OSError):
    """Page-locking was required (``pin=True``) but CuPy or a GPU is missing, or it failed."""


def _describe_pin_error(exc: Exception) -> str:
    if isinstance(exc, NoGpu):
        return str(exc) if str(exc) == "no CuPy" else "no CUDA device"
    return f"{type(exc).__name__}: {exc}"


def pin_chunk_bytes(capacity_bytes: int, workers: int, unit: int) -> int:
    """The registration unit: the pool split among ``workers`` threads (each chunk a multiple of
    ``unit``, at least 1 GiB, at most ``PIN_CHUNK_BYTES``)."""
    share = shares(capacity_bytes, workers, unit)[0][1]
    return max(unit, min(share, PIN_CHUNK_BYTES // unit * unit))


class HostPool:
    """``capacity_bytes`` of host memory handed out as aligned ``Allocation`` ranges.

    ``pin``: True requires page-locking (PinError if impossible), False never pins, None pins when
    CuPy and a GPU are present. ``populate`` faults the whole buffer in at start (a fresh page
    costs more than its copy: SSD reads into untouched memory ran at 65% of disk speed, 90% into
    populated memory). ``chunk_bytes``: the page-locking unit (default: the pool split among
    ``workers`` threads, at least 1 GiB, at most 64 GiB). ``base_address`` is the buffer's address.
    """

    def __init__(self, capacity_bytes: int, alignment: int = 4096, pin: bool | None = None,
                 populate: bool = True, chunk_bytes: int | None = None,
                 workers: int | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if alignment > mmap.PAGESIZE and alignment % mmap.PAGESIZE:
            raise ValueError("alignment above the page size must be a multiple of it")
        unit = max(alignment, mmap.PAGESIZE)
        workers = workers or default_workers()
        if chunk_bytes is None:
            chunk_bytes = pin_chunk_bytes(capacity_bytes, workers, unit)
        if chunk_bytes < capacity_bytes and (chunk_bytes < 2 * alignment or chunk_bytes % unit):
            raise ValueError(f"chunk_bytes {chunk_bytes} must be a multiple of the alignment and "
                             "of the page size, at least two alignment units")
        self._alloc = OffsetAllocator(capacity_bytes, alignment)
        self.capacity_bytes = self._alloc.capacity_bytes
        if self.capacity_bytes == 0:
            raise ValueError(f"capacity_bytes {capacity_bytes} is below one {alignment} B unit")
        self.alignment = alignment
        self.chunk_bytes = chunk_bytes
        # One fence before every inner chunk boundary (see the module docstring).
        self._fences = {}
        for boundary in range(chunk_bytes, self.capacity_bytes, chunk_bytes):
            fence = self._alloc.allocate_at(boundary - alignment, 0)
            assert fence is not None
            self._fences[fence.offset] = fence
        self._mmap = map_anonymous(self.capacity_bytes)
        handle = ctypes.c_char.from_buffer(self._mmap)
        self.base_address = ctypes.addressof(handle)
        del handle  # drop the buffer export so close() can unmap
        self._view = memoryview(self._mmap)
        self._pinned_chunks: list[int] = []
        self.pin_error: str | None = None  # why the pool is not page-locked, if it was tried
        try:
            if populate:  # every page now, not inside the first copy or O_DIRECT read
                fault_in(self.base_address, self.capacity_bytes, workers)
            if pin is not False:
                self._pin(pin, workers)
        except BaseException:
            self._release()
            raise
        self.pinned = bool(self._pinned_chunks)

    def _pin(self, required: bool | None, workers: int) -> None:
        try:
            self._pinned_chunks = page_lock(self.base_address, self.capacity_bytes,
                                            self.chunk_bytes, workers)
        except Exception as exc:
            self.pin_error = _describe_pin_error(exc)
            if required:
                raise PinError(f"cannot page-lock the {format_bytes(self.capacity_bytes)} host "
                               f"pool: {self.pin_error}") from exc
            # No GPU is the CPU path's normal state; a GPU we could not pin for is not.
            level = logging.DEBUG if isinstance(exc, NoGpu) else logging.WARNING
            log.log(level, "host pool stays plain (unpinned) memory: %s", self.pin_error)

    @property
    def used_bytes(self) -> int:
        """Bytes held by allocations (the fences not counted)."""
        return self._alloc.used_bytes - self.fence_bytes

    @property
    def fence_bytes(self) -> int:
        return len(self._fences) * self.alignment

    @property
    def free_bytes(self) -> int:
        return self._alloc.free_bytes

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) addresses of each chunk: a copy's host range lies inside one of them."""
        return [(self.base_address + start,
                 self.base_address + min(start + self.chunk_bytes, self.capacity_bytes))
                for start in range(0, self.capacity_bytes, self.chunk_bytes)]

    @property
    def largest_free_bytes(self) -> int:
        return self._alloc.largest_free_bytes

    @property
    def num_allocations(self) -> int:
        return self._alloc.num_allocations - len(self._fences)

    def reserved_size(self, num_bytes: int) -> int:
        return self._alloc.reserved_size(num_bytes)

    def allocate(self, num_bytes: int) -> Allocation | None:
        """An aligned range of at least ``num_bytes``, or None when no free extent fits."""
        return self._alloc.allocate(num_bytes)

    def free(self, alloc: Allocation) -> None:
        if alloc.offset in self._fences:
            raise ValueError(f"free of an unknown allocation {alloc}")
        self._alloc.free(alloc)

    def view(self, alloc: Allocation, padded: bool = False) -> memoryview:
        """Writable bytes of ``alloc``: ``num_bytes`` of them, or all reserved ones if padded."""
        end = alloc.offset + (alloc.reserved_bytes if padded else alloc.num_bytes)
        return self._view[alloc.offset:end]

    def address(self, alloc: Allocation) -> int:
        return self.base_address + alloc.offset

    def check_integrity(self) -> None:
        """Free + allocated == capacity, no overlap, no uncoalesced free neighbours."""
        self._alloc.check_integrity()

    def allocations(self) -> list[tuple[int, int]]:
        """(offset, reserved bytes) of every allocation handed out (the fences not listed)."""
        return [a for a in self._alloc.allocations() if a[0] not in self._fences]

    def close(self) -> None:
        """Unpin and unmap. Views handed out must not be used afterwards."""
        page_unlock(self._pinned_chunks)
        self._pinned_chunks = []
        self._release()

    def _release(self) -> None:
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view: the mapping goes with the last one
            log.debug("host pool views still exported at close; unmapped when they are dropped")
