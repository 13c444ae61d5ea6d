"""RequestLatency: the request latency histogram of the verbs on the engine's critical path."""

from __future__ import annotations

import threading
from collections import Counter

from prometheus_client import Histogram

# lookup, load and save are what an engine waits on (LMCache exports the same three).
TIMED_VERBS = ("lookup", "load", "save", "lookup_load")
# Seconds: from 50 µs (a lookup on a warm index) to 10 s (a large load from SSD).
BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
             0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RequestLatency:
    """``kvstore_request_duration_seconds{verb}`` of the timed verbs: a prometheus_client
    histogram in no global registry (the admin app registers it in its own), and each verb's
    count and total for ``stats`` (``summary``); thread-safe."""

    def __init__(self) -> None:
        self.histogram = Histogram(
            "kvstore_request_duration_seconds",
            "lookup, load and save: request received to reply sent", ["verb"],
            buckets=BUCKETS_S, registry=None)
        for verb in TIMED_VERBS:
            self.histogram.labels(verb)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._sums_s: Counter[str] = Counter()

    def observe(self, verb: str, elapsed_s: float) -> None:
        """One request of ``verb`` took ``elapsed_s`` (received to reply); other verbs are not
        timed."""
        if verb in TIMED_VERBS:
            self.histogram.labels(verb).observe(elapsed_s)
            with self._lock:
                self._counts[verb] += 1
                self._sums_s[verb] += elapsed_s

    def summary(self) -> dict[str, dict[str, float]]:
        """``{verb: {"count": n, "sum_ms": total}}`` of the timed verbs seen so far: a mean
        without scraping the histogram."""
        with self._lock:
            return {verb: {"count": self._counts[verb],
                           "sum_ms": round(1e3 * self._sums_s[verb], 3)}
                    for verb in TIMED_VERBS if self._counts[verb]}
