"""VerbLatency: request latency histograms of the verbs on the engine's critical path."""

from __future__ import annotations

import bisect
import threading

# lookup, load and save are what an engine waits on (LMCache exports the same three).
TIMED_VERBS = ("lookup", "load", "save")
# Seconds: from 50 µs (a lookup on a warm index) to 10 s (a large load from SSD).
BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
             0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class VerbLatency:
    """Cumulative bucket counts and sums per timed verb; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {verb: [0] * (len(BUCKETS_S) + 1) for verb in TIMED_VERBS}  # +Inf last
        self._sums = dict.fromkeys(TIMED_VERBS, 0.0)

    def observe(self, verb: str, elapsed_s: float) -> None:
        """One request of `verb` took `elapsed_s` (received to reply); other verbs are skipped."""
        counts = self._counts.get(verb)
        if counts is None:
            return
        with self._lock:
            counts[bisect.bisect_left(BUCKETS_S, elapsed_s)] += 1
            self._sums[verb] += elapsed_s

    def snapshot(self) -> dict[str, tuple[list[tuple[str, int]], float]]:
        """verb -> ([(upper bound, cumulative count)... ("+Inf", total)], sum of seconds)."""
        with self._lock:
            out = {}
            for verb, counts in self._counts.items():
                running, buckets = 0, []
                for bound, count in zip((*map(str, BUCKETS_S), "+Inf"), counts):
                    running += count
                    buckets.append((bound, running))
                out[verb] = (buckets, self._sums[verb])
            return out
