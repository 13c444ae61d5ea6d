"""Load bandwidth as the restore policy samples it: bytes landed over the time loads were busy."""

from __future__ import annotations

from collections import Counter

# A busy period yields its sample once this many loads of it ended, even if others are still in
# flight: under steady traffic the loads may never all be done at once.
MAX_LOADS_PER_SAMPLE = 8


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class LoadBusyPeriods:
    """Bandwidth samples of one engine's loads: the bytes landed by the loads of a busy period
    over the union of their lifetimes (start to reply), under the tier most bytes came from.

    Loads of one engine share the bus and the daemon may interleave their chunks, so neither a
    load's own latency (queued behind others) nor its time since the previous landing
    (interleaved) is the bus's figure (docs/measurements.md, "Restore policy"); the union of
    the lifetimes is the time the bus was theirs, and gaps between loads count for none. A period
    closes when no load is in flight, or once ``MAX_LOADS_PER_SAMPLE`` of its loads ended. A
    load that landed nothing (failed, timed out, given up, or answered with no block) adds
    neither bytes nor time.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self._intervals: list[tuple[float, float]] = []
        self._bytes: Counter[str] = Counter()

    def started(self) -> None:
        self.in_flight += 1

    def ended(self, started_at: float, ended_at: float,
              bytes_by_tier: dict[str, int]) -> tuple[str, int, float] | None:
        """A load that started at ``started_at`` ended at ``ended_at`` having landed
        ``bytes_by_tier``; (tier, bytes, seconds) when that closed a period with bytes."""
        if self.in_flight == 0:
            return None  # more endings than starts: a caller's bug, never a sample
        self.in_flight -= 1
        if bytes_by_tier and ended_at > started_at:
            self._intervals.append((started_at, ended_at))
            self._bytes.update(bytes_by_tier)
        if self.in_flight and len(self._intervals) < MAX_LOADS_PER_SAMPLE:
            return None
        intervals, landed = self._intervals, self._bytes
        self._intervals, self._bytes = [], Counter()
        if not intervals:
            return None
        tier, _ = landed.most_common(1)[0]
        return tier, sum(landed.values()), busy_seconds(intervals)
