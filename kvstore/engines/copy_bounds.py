"""Bounds every device copy is checked against before it is submitted.

An illegal address in a CUDA copy is sticky: it ends the daemon's context for every engine it
serves. So nothing is handed to a copier that was not checked first: engine block ids against the
registration's block count, host addresses against the spans of the store's pinned memory (one
copy may not cross from one span into the next: the driver refuses it). A chunk's few addresses
by a bisect each, larger batches vectorised: a few microseconds either way.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

# Up to this many addresses are checked one by one (a load's chunk of 2.36 MB blocks has 2-14).
_FEW = 32


class CopyOutOfBounds(ValueError):
    """A copy would touch memory outside what it was checked against; nothing was submitted."""


class HostSpans:
    """Sorted, disjoint (start, end) address ranges; ``check`` that ranges lie inside one."""

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        ordered = sorted(spans)
        self._start_list = [int(s) for s, _ in ordered]
        self._end_list = [int(e) for _, e in ordered]
        self._starts = np.array(self._start_list, dtype=np.int64)
        self._ends = np.array(self._end_list, dtype=np.int64)

    def check(self, addrs: Sequence[int] | np.ndarray, num_bytes: int) -> None:
        """CopyOutOfBounds unless every ``[addrs[i], addrs[i] + num_bytes)`` lies inside one
        span."""
        if len(addrs) <= _FEW:  # a chunk's few: a bisect each, cheaper than building arrays
            starts, ends = self._start_list, self._end_list
            for a in addrs:
                i = bisect_right(starts, a) - 1
                if i < 0 or a + num_bytes > ends[i]:
                    raise _outside(int(a), num_bytes)
            return
        addr = np.asarray(addrs, dtype=np.int64)
        i = np.searchsorted(self._starts, addr, side="right") - 1
        inside = (i >= 0) & (addr + num_bytes <= self._ends[np.maximum(i, 0)])
        if not inside.all():
            raise _outside(int(addr[np.flatnonzero(~inside)[0]]), num_bytes)


def _outside(addr: int, num_bytes: int) -> CopyOutOfBounds:
    return CopyOutOfBounds(f"host range {addr:#x}+{num_bytes} lies outside the store's pinned "
                           "spans or across two of them")


def check_block_ids(block_ids: np.ndarray, num_blocks: int) -> None:
    """CopyOutOfBounds unless every id is a block of a ``num_blocks`` arena."""
    if block_ids.size and (int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks):
        raise CopyOutOfBounds(f"block ids {int(block_ids.min())}..{int(block_ids.max())} "
                              f"outside the arena's {num_blocks} blocks")
