"""The DRAM tier's memory: one host buffer allocated at start, carved by an offset allocator.

The buffer is one anonymous mapping (page aligned, so every aligned allocation is also fit for
O_DIRECT). When CuPy sees a GPU it is page-locked with ``cudaHostRegister`` in chunks of at most
64 GiB, so the copy engines can DMA straight from it; otherwise it stays plain memory and the CPU
path behaves the same.

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

log = logging.getLogger(__name__)

__all__ = ["Allocation", "HostPool", "PinError"]

PIN_CHUNK_BYTES = 64 << 30
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


class PinError(OSError):
    """Page-locking was required (``pin=True``) but CuPy or a GPU is missing, or it failed."""


class NoGpu(PinError):
    """CuPy or a CUDA device is missing: nothing to pin for."""


_NO_GPU_ERRORS = (ImportError, NoGpu)


def _describe_pin_error(exc: Exception) -> str:
    if isinstance(exc, ImportError):
        return "no CuPy"
    if isinstance(exc, NoGpu):
        return "no CUDA device"
    return f"{type(exc).__name__}: {exc}"


def _register_pinned(address: int, size: int, chunk_bytes: int) -> list[int]:
    """Page-lock [address, address + size) in chunks; returns the chunk addresses to unregister."""
    import cupy

    try:
        num_devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver: CuPy raises instead of counting 0
        raise NoGpu(str(exc)) from None
    if num_devices <= 0:
        raise NoGpu("no CUDA device")
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    chunks: list[int] = []
    try:
        for off in range(0, size, chunk_bytes):
            cupy.cuda.runtime.hostRegister(address + off, min(chunk_bytes, size - off), flags)
            chunks.append(address + off)
    except Exception:
        _unregister_pinned(chunks)
        raise
    return chunks


def _unregister_pinned(chunks: list[int]) -> None:
    if not chunks:
        return
    import cupy

    for addr in chunks:
        try:
            cupy.cuda.runtime.hostUnregister(addr)
        except Exception as exc:  # at interpreter exit the runtime may already be gone
            log.warning("cudaHostUnregister(%#x) failed: %s", addr, exc)


class HostPool:
    """``capacity_bytes`` of host memory handed out as aligned ``Allocation`` ranges.

    ``pin``: True requires page-locking (PinError if impossible), False never pins, None pins when
    CuPy and a GPU are present. ``populate`` faults the whole buffer in at start (about a second
    per 8 GiB; a fresh page costs more than its copy: SSD reads into untouched memory ran at 65%
    of disk speed, 90% into populated memory). ``base_address`` is the buffer's address.
    """

    def __init__(self, capacity_bytes: int, alignment: int = 4096, pin: bool | None = None,
                 populate: bool = True, chunk_bytes: int = PIN_CHUNK_BYTES) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if alignment > mmap.PAGESIZE and alignment % mmap.PAGESIZE:
            raise ValueError("alignment above the page size must be a multiple of it")
        if chunk_bytes < 2 * alignment or chunk_bytes % max(alignment, mmap.PAGESIZE):
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
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if populate:  # fault every page in now, not inside the first copy or O_DIRECT read
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        self._mmap = mmap.mmap(-1, self.capacity_bytes, flags=flags)
        handle = ctypes.c_char.from_buffer(self._mmap)
        self.base_address = ctypes.addressof(handle)
        del handle  # drop the buffer export so close() can unmap
        self._view = memoryview(self._mmap)
        self._pinned_chunks: list[int] = []
        self.pin_error: str | None = None  # why the pool is not page-locked, if it was tried
        if pin is not False:
            try:
                self._pinned_chunks = _register_pinned(self.base_address, self.capacity_bytes,
                                                       chunk_bytes)
            except Exception as exc:
                self.pin_error = _describe_pin_error(exc)
                if pin:
                    self._release()
                    raise PinError(f"cannot page-lock the {format_bytes(capacity_bytes)} host "
                                   f"pool: {self.pin_error}") from exc
                # No GPU is the CPU path's normal state; a GPU we could not pin for is not.
                level = logging.DEBUG if isinstance(exc, _NO_GPU_ERRORS) else logging.WARNING
                log.log(level, "host pool stays plain (unpinned) memory: %s", self.pin_error)
        self.pinned = bool(self._pinned_chunks)

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
        _unregister_pinned(self._pinned_chunks)
        self._pinned_chunks = []
        self._release()

    def _release(self) -> None:
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view: the mapping goes with the last one
            log.debug("host pool views still exported at close; unmapped when they are dropped")
