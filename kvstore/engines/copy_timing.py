"""CopyTiming: where a device's whole-block saves and loads spend their time, summed.

A copy pipeline (``copy_pipeline``) times each save and load it runs in phases (``CallClock``) and
adds them here, per way (``CopyWay``): the call's wall time, the time until its first chunk was
enqueued (the first submission returned; the bus idle until then), the time after its last
submission returned (the copies still in flight, then publishing or handing back), the time in the
store's verbs (``begin_write`` and ``commit`` per block for a save, ``read_addresses`` and
``done_range`` per chunk for a load) and in submissions (building runs, the driver call, and any
wait for the interpreter's lock behind another thread; a failed one included). The phases overlap:
the first submission counts in ``to_first_submit`` and in ``submitting``, and every verb and
submission in ``total``. The daemon's ``stats`` show the sums (``daemon.copy_ms``), so a workload's
own restores can be split without a tracer: a load whose submissions take far longer than in
``benchmarks.transfer_daemon`` was held up by other work in the daemon.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

PHASES = ("total", "to_first_submit", "after_last_submit", "store", "submitting")


class CopyWay(str, enum.Enum):
    """Which way a pipeline call moved blocks (the key in ``daemon.copy_ms``)."""

    SAVE = "save"  # engine HBM -> the pinned pool
    LOAD = "load"  # the pinned pool -> engine HBM


class CopyTiming:
    """Per-way sums of phase milliseconds, calls and chunks; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, Counter[str]] = {way.value: Counter() for way in CopyWay}

    def add(self, way: CopyWay, num_chunks: int, **phase_s: float) -> None:
        """One call of ``way`` that ran ``num_chunks`` submissions; ``phase_s``: seconds by
        ``PHASES`` name (unknown names are a programming error)."""
        unknown = set(phase_s) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown copy phases {sorted(unknown)}")
        with self._lock:
            sums = self._sums[CopyWay(way).value]
            sums["calls"] += 1
            sums["chunks"] += num_chunks
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
        total: dict[str, Counter[str]] = {}
        for snap in snapshots:
            for way, sums in snap.items():
                total.setdefault(way, Counter()).update(sums)
        return {way: {k: round(v, 3) for k, v in sums.items()} for way, sums in total.items()}


@dataclass(eq=False)
class CallClock:
    """One pipeline call's phases, by ``time.perf_counter``; ``report`` adds them to a
    ``CopyTiming``."""

    start_at: float = field(default_factory=time.perf_counter)
    first_submit_at: float | None = None  # when the first submission returned
    last_submit_at: float | None = None
    store_s: float = 0.0  # in the store's per-block verbs
    submit_s: float = 0.0  # in submissions
    num_chunks: int = 0

    def store_verb(self, verb: Callable, *args):
        """``verb(*args)`` (one of the store's per-block verbs), its time counted."""
        began = time.perf_counter()
        try:
            return verb(*args)
        finally:
            self.store_s += time.perf_counter() - began

    def submitted(self, began_at: float) -> None:
        """A submission that began at ``began_at`` has just returned (or failed)."""
        now = time.perf_counter()
        self.submit_s += now - began_at
        self.num_chunks += 1
        if self.first_submit_at is None:
            self.first_submit_at = now
        self.last_submit_at = now

    def report(self, timing: CopyTiming, way: CopyWay) -> None:
        """The call is over: its phases into ``timing`` (a call that enqueued nothing has
        every phase but ``total``, ``store`` and ``submitting`` zero)."""
        end = time.perf_counter()
        first = end if self.first_submit_at is None else self.first_submit_at
        last = end if self.last_submit_at is None else self.last_submit_at
        timing.add(way, self.num_chunks, total=end - self.start_at,
                   to_first_submit=first - self.start_at, after_last_submit=end - last,
                   store=self.store_s, submitting=self.submit_s)
