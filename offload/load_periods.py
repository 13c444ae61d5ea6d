"""Load bandwidth as the restore policy samples it: bytes landed per busy period of the loads."""

from __future__ import annotations

from collections import Counter


class LoadBusyPeriods:
    """Bandwidth samples of one engine's loads, one per busy period.

    A busy period runs from the start of a load while none was in flight to the landing of the
    last load in flight; its sample is the bytes landed in it over its length, under the tier
    most of them came from. Loads of one engine share the bus (and the daemon may interleave
    their chunks), so a load's own latency reads too slow when it queued behind others, and its
    time since the previous landing reads absurdly fast when their chunks interleaved (an H100
    run measured 11.7 TB/s that way); the period's total is neither.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self._since = self._until = 0.0
        self._bytes: Counter[str] = Counter()
        self._poisoned = False  # a load of this period failed or was given up

    def started(self, at: float) -> None:
        if self.in_flight == 0:
            self._since, self._until, self._bytes, self._poisoned = at, at, Counter(), False
        self.in_flight += 1

    def ended(self, at: float, bytes_by_tier: dict[str, int]) -> tuple[str, int, float] | None:
        """A load of the period ended at ``at`` having landed ``bytes_by_tier`` (empty: it
        failed, timed out or was given up, and the period yields no sample). (tier, bytes,
        seconds) when that closed the period."""
        if self.in_flight == 0:
            return None
        self.in_flight -= 1
        self._until = max(self._until, at)
        self._bytes.update(bytes_by_tier)
        self._poisoned = self._poisoned or not bytes_by_tier
        if self.in_flight or self._poisoned or self._until <= self._since:
            return None
        tier, _ = self._bytes.most_common(1)[0]
        return tier, sum(self._bytes.values()), self._until - self._since
