"""The daemon's own counters: requests by verb, errors by code, events by name; thread-safe."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class DaemonCounters:
    """Every request is counted once (``count_request``); events by whoever sees them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()  # by verb
        self._errors: Counter[str] = Counter()  # by code
        self._events: Counter[str] = Counter()  # connections, leases expired, blocks saved...

    def count_request(self, verb: str, error_code: str | None) -> None:
        with self._lock:
            self._requests[verb] += 1
            if error_code is not None:
                self._errors[error_code] += 1

    def add(self, **events: int) -> None:
        """Add to named events, e.g. ``add(blocks_saved=3, blocks_save_failed=1)``."""
        with self._lock:
            for name, num in events.items():
                self._events[name] += num

    def declare(self, names: Iterable[str]) -> None:
        """Events present from now on even at zero (exported series never appear late)."""
        with self._lock:
            for name in names:
                self._events.setdefault(name, 0)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"requests": dict(self._requests), "errors": dict(self._errors),
                    "events": dict(self._events)}
