"""Stalls: how long the daemon's control loop went without running, and what the cyclic garbage
collector took, so that a late reply (an engine's probe counting the store as hung) can be told
apart as a collection, a loop held by a call, or neither.

The loop's heartbeat (``health.LoopHeartbeat``) reports each tick's lateness here; ``install``
hooks ``gc.callbacks`` for the daemon's lifetime. Both are counted (``report``, in ``stats`` as
``daemon.stalls``) and a long one is logged, at most once a minute. ``watch_stacks`` (``kvstore
serve`` with ``KVSTORE_DEBUG_STALL_STACKS=1``, for diagnosis) also has every thread's stack
written to a file when the loop has not ticked for ``STACKS_AFTER_S``, by ``faulthandler``'s
watchdog: a C thread that needs no GIL, so it sees a call that holds the GIL too. It reads the
other threads' frames without the GIL, which is unsafe while they run (a stall that ends during
the dump), hence off by default. At most ``MAX_STACK_DUMPS`` per process.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TextIO

log = logging.getLogger("kvstore.daemon.stalls")

# A pause this long is logged (rate-limited) and counted as long: an engine's probe waits 0.75 s.
LONG_PAUSE_S = 0.1
_LOG_INTERVAL_S = 60.0
# ``watch_stacks``: a loop this late has every thread's stack written out, a few times at most.
STACKS_AFTER_S = 0.5
MAX_STACK_DUMPS = 3


class Stalls:
    """Loop lateness and collector pauses, counted. Without a lock: the collector's fields are
    written only inside collections (one at a time, under the GIL, on whichever thread
    allocates), the loop's only by the loop; a lock taken in a collector callback could be the
    one its own thread holds."""

    def __init__(self) -> None:
        self.loop_lag_s_max = 0.0
        self.loop_lags_long = 0
        self.gc_collections = [0, 0, 0]  # by generation
        self.gc_s_total = 0.0
        self.gc_s_max = 0.0
        self.gc_pauses_long = 0
        self._gc_started: float | None = None
        self._gc_note: str | None = None  # a long collection, logged by the next tick
        self._next_log_at = 0.0
        self._installed = False
        self._stacks_to: TextIO | None = None  # ``watch_stacks``: armed at every tick
        self.stack_file: str | None = None
        self._interval_s = 0.0
        self.stack_dumps = 0

    # -- the control loop ---------------------------------------------------------------

    def loop_ticked(self, lag_s: float) -> None:
        """The heartbeat ran ``lag_s`` later than it asked to (and logs what is due)."""
        self._rearm_stacks(lag_s)
        self.loop_lag_s_max = max(self.loop_lag_s_max, lag_s)
        long = lag_s >= LONG_PAUSE_S
        self.loop_lags_long += long
        note, self._gc_note = self._gc_note, None
        if long:
            self._log(f"the control loop ran {1e3 * lag_s:.0f} ms late")
        if note is not None:
            self._log(note)

    def watch_stacks(self, interval_s: float, directory: Path) -> None:
        """From now on, every thread's stack is written to a file of its own in ``directory``
        (``stack_file``) when the loop, ticking every ``interval_s``, has not ticked for
        ``STACKS_AFTER_S``. A file, not stderr: re-arming waits for a dump in progress with
        the GIL held, and a pipe nobody reads would stop the whole daemon there. Process-wide
        (one such watchdog per process), so the daemon's command turns it on, never a library
        user."""
        try:
            fd, path = tempfile.mkstemp(prefix="kvstore-stacks-", suffix=".txt", dir=directory)
        except OSError as exc:
            log.warning("no stack dumps of a stalled loop: cannot make a file in %s: %s",
                        directory, exc)
            return
        self._stacks_to = os.fdopen(fd, "w")
        self.stack_file = path
        self._interval_s = interval_s
        self._rearm_stacks(0.0)

    def stop_watching_stacks(self) -> None:
        """The watchdog off; its file removed if nothing was written to it."""
        out, self._stacks_to = self._stacks_to, None
        if out is None:
            return
        faulthandler.cancel_dump_traceback_later()
        out.close()
        if self.stack_file is not None and os.path.getsize(self.stack_file) == 0:
            os.unlink(self.stack_file)
            self.stack_file = None

    def _rearm_stacks(self, lag_s: float) -> None:
        if self._stacks_to is None:
            return
        if lag_s + self._interval_s >= STACKS_AFTER_S:  # the watchdog fired meanwhile
            self.stack_dumps += 1
            log.warning("every thread's stack, %.0f ms into a stalled loop, is in %s "
                        "(at most %d such dumps)", 1e3 * lag_s, self.stack_file,
                        MAX_STACK_DUMPS)
            if self.stack_dumps >= MAX_STACK_DUMPS:
                self.stop_watching_stacks()
                return
        faulthandler.dump_traceback_later(STACKS_AFTER_S, repeat=False, file=self._stacks_to)

    # -- the cyclic collector -----------------------------------------------------------

    def install(self) -> None:
        """Time every collection from now until ``uninstall``."""
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        """The daemon stops: collections untimed, the stack watchdog off (a loop shutting
        down does not tick)."""
        self.stop_watching_stacks()
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict) -> None:
        # Runs inside the collector on whichever thread collects: count only; a long pause is
        # logged by the loop's next tick (no logging lock taken in here).
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        started, self._gc_started = self._gc_started, None
        if started is None:
            return
        took = time.perf_counter() - started
        generation = int(info.get("generation", 2))
        self.gc_collections[min(2, max(0, generation))] += 1
        self.gc_s_total += took
        self.gc_s_max = max(self.gc_s_max, took)
        if took >= LONG_PAUSE_S:
            self.gc_pauses_long += 1
            self._gc_note = (f"a generation-{generation} garbage collection took "
                             f"{1e3 * took:.0f} ms ({int(info.get('collected', 0))} objects "
                             "collected)")

    # -- reading ------------------------------------------------------------------------

    def report(self) -> dict:
        """The counts, for ``stats`` (``daemon.stalls``)."""
        return {"loop_lag_ms_max": round(1e3 * self.loop_lag_s_max, 3),
                "loop_lags_long": self.loop_lags_long,
                "gc_collections": list(self.gc_collections),
                "gc_ms_total": round(1e3 * self.gc_s_total, 3),
                "gc_ms_max": round(1e3 * self.gc_s_max, 3),
                "gc_pauses_long": self.gc_pauses_long, "stack_dumps": self.stack_dumps,
                "stack_file": self.stack_file}

    def _log(self, message: str) -> None:
        now = time.monotonic()
        if now < self._next_log_at:
            return
        self._next_log_at = now + _LOG_INTERVAL_S
        log.warning("%s (counted in stats: daemon.stalls)", message)
