"""RequestLatency: the request latency histogram of the verbs on the engine's critical path."""

from __future__ import annotations

from prometheus_client import Histogram

# lookup, load and save are what an engine waits on (LMCache exports the same three).
TIMED_VERBS = ("lookup", "load", "save", "lookup_load")
# Seconds: from 50 µs (a lookup on a warm index) to 10 s (a large load from SSD).
BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
             0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RequestLatency:
    """``kvstore_request_duration_seconds{verb}`` of the timed verbs: a prometheus_client
    histogram in no global registry (the admin app registers it in its own); thread-safe."""

    def __init__(self) -> None:
        self.histogram = Histogram(
            "kvstore_request_duration_seconds",
            "lookup, load and save: request received to reply sent", ["verb"],
            buckets=BUCKETS_S, registry=None)
        for verb in TIMED_VERBS:
            self.histogram.labels(verb)

    def observe(self, verb: str, elapsed_s: float) -> None:
        """One request of ``verb`` took ``elapsed_s`` (received to reply); other verbs are not
        timed."""
        if verb in TIMED_VERBS:
            self.histogram.labels(verb).observe(elapsed_s)
