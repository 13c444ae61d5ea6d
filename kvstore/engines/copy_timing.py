"""CopyTiming: where a device's whole-block saves and loads spend their time, summed.

A copy pipeline (``copy_pipeline``) times each save and load it runs in phases and adds them
here, per way (``save`` / ``load``): the call's wall time, the time before its first chunk was
handed to the copier (the bus idle meanwhile), the time after its last submission (the copies
still in flight, then publishing or handing back), the time in the store's per-block verbs
(``begin_write`` and ``commit`` for a save, ``read`` and ``done`` for a load) and in
submissions (building runs, the driver call, and any wait for the interpreter's lock behind
another thread). The daemon's ``stats`` show the sums (``daemon.copy_ms``), so a workload's own
restores can be split without a tracer: a load whose submissions take far longer than in
``benchmarks.transfer_daemon`` was held up by other work in the daemon.
"""

from __future__ import annotations

import threading
from collections import Counter

PHASES = ("total", "to_first_submit", "after_last_submit", "store", "submitting")


class CopyTiming:
    """Per-way sums of phase milliseconds, calls and chunks; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, Counter[str]] = {"save": Counter(), "load": Counter()}

    def add(self, way: str, chunks: int, **phase_s: float) -> None:
        """One call of ``way`` that ran ``chunks`` submissions; ``phase_s``: seconds by
        ``PHASES`` name (unknown names are a programming error)."""
        unknown = set(phase_s) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown copy phases {sorted(unknown)}")
        with self._lock:
            sums = self._sums[way]
            sums["calls"] += 1
            sums["chunks"] += chunks
            for name, seconds in phase_s.items():
                sums[f"ms_{name}"] += seconds * 1e3

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{way: {calls, chunks, ms_<phase>...}}``, milliseconds rounded to µs."""
        with self._lock:
            return {way: {k: round(v, 3) for k, v in sums.items()}
                    for way, sums in self._sums.items() if sums}

    @staticmethod
    def merged(snapshots: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
        """Several copiers' snapshots summed (a daemon with engines on several devices)."""
        total: dict[str, Counter] = {}
        for snap in snapshots:
            for way, sums in snap.items():
                total.setdefault(way, Counter()).update(sums)
        return {way: {k: round(v, 3) for k, v in sums.items()} for way, sums in total.items()}
