"""An offset allocator: best-fit over a sorted free list of extents, coalescing on free.

Plain integers only; it never touches memory or files. The host pool and the SSD tier each carve
their space with one. Every extent is a multiple of ``alignment`` and starts at a multiple of it,
so an allocation's reserved bytes are always safe for O_DIRECT and for aligned device copies.
Not thread-safe: the owner holds its lock.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    """``num_bytes`` asked for at ``offset``; ``reserved_bytes`` (aligned up) are held for it."""

    offset: int
    num_bytes: int
    reserved_bytes: int

    @property
    def end(self) -> int:
        return self.offset + self.reserved_bytes


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class OffsetAllocator:
    """Hands out aligned, non-overlapping ranges of ``[0, capacity_bytes)``.

    Invariant: free extents never touch each other (they are coalesced on free), and
    free_bytes + used_bytes == capacity_bytes.
    """

    def __init__(self, capacity_bytes: int, alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.alignment = alignment
        self.capacity_bytes = capacity_bytes // alignment * alignment
        self._free_starts: list[int] = []  # sorted starts of free extents
        self._free_size: dict[int, int] = {}  # start -> size
        self._by_size: list[tuple[int, int]] = []  # sorted (size, start): best fit, lowest address
        self._used: dict[int, int] = {}  # offset -> reserved bytes
        self.used_bytes = 0
        if self.capacity_bytes:
            self._add_free(0, self.capacity_bytes)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def num_allocations(self) -> int:
        return len(self._used)

    @property
    def largest_free_bytes(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def reserved_size(self, num_bytes: int) -> int:
        """What an allocation of ``num_bytes`` holds (a zero-byte one still holds one unit)."""
        return align_up(max(num_bytes, 1), self.alignment)

    def allocate(self, num_bytes: int) -> Allocation | None:
        """The smallest free extent that fits, or None when none does (never raises for size)."""
        if num_bytes < 0:
            raise ValueError("num_bytes must be >= 0")
        need = self.reserved_size(num_bytes)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        size, start = self._by_size[i]
        self._remove_free(start, size, by_size_index=i)
        if size > need:
            self._add_free(start + need, size - need)
        return self._take(start, num_bytes, need)

    def allocate_at(self, offset: int, num_bytes: int) -> Allocation | None:
        """Take exactly ``[offset, offset + reserved)`` if it is free, else None."""
        need = self.reserved_size(num_bytes)
        if offset % self.alignment:
            raise ValueError(f"offset {offset} is not aligned to {self.alignment}")
        j = bisect.bisect_right(self._free_starts, offset) - 1
        if j < 0:
            return None
        start = self._free_starts[j]
        size = self._free_size[start]
        if offset + need > start + size:
            return None
        self._remove_free(start, size)
        if offset > start:
            self._add_free(start, offset - start)
        if start + size > offset + need:
            self._add_free(offset + need, start + size - offset - need)
        return self._take(offset, num_bytes, need)

    def free(self, alloc: Allocation) -> None:
        """Return an allocation; its extent merges with free neighbours. Double free raises."""
        reserved = self._used.get(alloc.offset)
        if reserved is None or reserved != alloc.reserved_bytes:
            raise ValueError(f"free of an unknown allocation {alloc}")
        del self._used[alloc.offset]
        self.used_bytes -= reserved
        start, size = alloc.offset, reserved
        j = bisect.bisect_left(self._free_starts, start)
        if j > 0:
            prev = self._free_starts[j - 1]
            prev_size = self._free_size[prev]
            if prev + prev_size == start:
                self._remove_free(prev, prev_size)
                start, size = prev, size + prev_size
        nxt = start + size
        nxt_size = self._free_size.get(nxt)
        if nxt_size is not None:
            self._remove_free(nxt, nxt_size)
            size += nxt_size
        self._add_free(start, size)

    def allocations(self) -> list[tuple[int, int]]:
        """(offset, reserved bytes) of every live allocation, sorted by offset."""
        return sorted(self._used.items())

    def check_integrity(self) -> None:
        """Raise AssertionError unless free and used extents tile the capacity exactly."""
        extents = [(s, self._free_size[s], "free") for s in self._free_starts]
        extents += [(s, n, "used") for s, n in self._used.items()]
        extents.sort()
        pos = 0
        prev_kind = ""
        for start, size, kind in extents:
            assert start == pos, f"gap or overlap at {pos}: next extent starts at {start}"
            assert size > 0 and size % self.alignment == 0, f"bad extent size {size} at {start}"
            assert not (kind == prev_kind == "free"), f"uncoalesced free extents at {start}"
            pos, prev_kind = start + size, kind
        assert pos == self.capacity_bytes, f"extents end at {pos}, capacity {self.capacity_bytes}"
        assert sorted(self._by_size) == self._by_size, "size index unsorted"
        assert sorted((n, s) for s, n in self._free_size.items()) == self._by_size, "size index"
        assert self._free_starts == sorted(self._free_size), "start index"
        assert self.used_bytes == sum(self._used.values()), "used_bytes drifted"

    def _take(self, start: int, num_bytes: int, reserved: int) -> Allocation:
        self._used[start] = reserved
        self.used_bytes += reserved
        return Allocation(start, num_bytes, reserved)

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free_size[start] = size
        bisect.insort(self._by_size, (size, start))

    def _remove_free(self, start: int, size: int, by_size_index: int | None = None) -> None:
        del self._free_starts[bisect.bisect_left(self._free_starts, start)]
        del self._free_size[start]
        i = by_size_index
        if i is None:
            i = bisect.bisect_left(self._by_size, (size, start))
        del self._by_size[i]
