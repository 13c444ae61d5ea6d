"""Bounds every device copy is checked against before it is submitted.

An illegal address in a CUDA copy is sticky: it ends the daemon's context for every engine it
serves. So nothing is handed to a copier that was not checked first: engine block ids against the
registration's block count, host addresses against the spans of the store's pinned memory (one
copy may not cross from one span into the next: the driver refuses it). Vectorised, a few
microseconds a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class CopyOutOfBounds(ValueError):
    """A copy would touch memory outside what it was checked against; nothing was submitted."""


class HostSpans:
    """Sorted, disjoint (start, end) address ranges; ``check`` that ranges lie inside one."""

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        ordered = sorted(spans)
        self._starts = np.array([s for s, _ in ordered], dtype=np.int64)
        self._ends = np.array([e for _, e in ordered], dtype=np.int64)

    def check(self, addrs: Sequence[int] | np.ndarray, num_bytes: int) -> None:
        """CopyOutOfBounds unless every ``[addrs[i], addrs[i] + num_bytes)`` lies inside one
        span."""
        addr = np.asarray(addrs, dtype=np.int64)
        if not addr.size:
            return
        i = np.searchsorted(self._starts, addr, side="right") - 1
        inside = (i >= 0) & (addr + num_bytes <= self._ends[np.maximum(i, 0)])
        if not inside.all():
            bad = int(addr[np.flatnonzero(~inside)[0]])
            raise CopyOutOfBounds(f"host range {bad:#x}+{num_bytes} lies outside the store's "
                                  "pinned spans or across two of them")


def check_block_ids(block_ids: np.ndarray, num_blocks: int) -> None:
    """CopyOutOfBounds unless every id is a block of a ``num_blocks`` arena."""
    if block_ids.size and (int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks):
        raise CopyOutOfBounds(f"block ids {int(block_ids.min())}..{int(block_ids.max())} "
                              f"outside the arena's {num_blocks} blocks")
