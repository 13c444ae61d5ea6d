"""RoutedPrefixes: the block chains the router has just sent to each engine, before the daemon
hears of them.

An engine publishes a prompt's blocks to the daemon only once it has computed them, so for the
length of a prefill the daemon's ``locate`` says nobody holds what a burst of requests sharing
a prefix all want. The router marks the chosen engine as holding the request's chain at once;
a later request's held prefix on an engine is the longer of the daemon's answer and this.
Marks expire after ``ttl_s``: long enough for a prefill to finish and the engine to publish,
short enough not to outlive the blocks (on two H200s under HBM pressure a 30 s mark claimed
conversations the engine had evicted 20 s before: their next turns went by a stale hit,
restored from DRAM anyway, while the estimate called them free). The table keeps at most
``max_blocks`` hashes (oldest first out). Plain data, no IO; on the router's event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence


class RoutedPrefixes:
    """Which engine was last sent which block hash, and when."""

    def __init__(self, ttl_s: float = 5.0, max_blocks: int = 1 << 20) -> None:
        if ttl_s <= 0 or max_blocks <= 0:
            raise ValueError("ttl_s and max_blocks must be positive")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        # hash -> {engine: when it was sent there}
        self._marks: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._marks)

    def mark(self, engine: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        """``engine`` now holds (or is computing) every block of ``hashes``."""
        now = time.monotonic() if now is None else now
        marks = self._marks
        for h in hashes:
            sent = marks.get(h)
            if sent is None:
                marks[h] = {engine: now}
            else:
                sent[engine] = now
                marks.move_to_end(h)
        while len(marks) > self.max_blocks:
            marks.popitem(last=False)

    def held(self, engine: str, hashes: Sequence[bytes], now: float | None = None) -> int:
        """How many leading blocks of ``hashes`` were sent to ``engine`` within ``ttl_s``.
        Chains are prefixes of each other, so the held ones are a leading run: binary search."""
        now = time.monotonic() if now is None else now
        lo, hi = 0, len(hashes)  # the answer lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            sent = self._marks.get(hashes[mid - 1], {}).get(engine)
            if sent is not None and now - sent <= self.ttl_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
