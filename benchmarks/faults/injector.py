"""Runs a fault schedule against a soak's stack while its load runs, and times each fault.

A thread waits for each fault's time (a fault whose time passed while the previous one was still
recovering runs at once), applies it, and records an outcome:

- ``daemon-stop``: SIGSTOP; the engine's /health is polled until it reports the store not ``ok``
  (``store_flagged_after_s``); SIGCONT after ``hold_s``; then polled until ``ok`` again
  (``store_ok_after_cont_s``).
- ``daemon-kill``: the daemon's stats (what this incarnation stored and served), SIGKILL, a new
  daemon on the same socket (``restart_s``), then the engine polled until it reports the store
  ``ok`` (``store_ok_after_restart_s``).
- ``engine-term`` / ``engine-kill``: once a request is in flight (waited for up to 10 s, so the
  stop hits the load), the engine's offload counters, the load's gate closed (the
  requests in flight are listed: they may fail), the signal, the exit (``exit_code``,
  ``exit_s``), a new engine listening and warmed (``listening_s``, ``warm_s``), the gate opened
  onto it (``gate_closed_s``).

A fault that cannot be applied or recovered from (a restart that fails) ends the schedule; the
outcome carries the error and the soak reports it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from benchmarks.faults.chat_load import ChatLoad
from benchmarks.faults.schedule import Fault, FaultKind
from benchmarks.faults.stack import SoakStack

POLL_S = 0.2
RECOVERY_TIMEOUT_S = 120.0
IN_FLIGHT_WAIT_S = 10.0  # an engine fault waits this long at most for a request in flight


class FaultInjector:
    """Applies ``faults`` to ``stack`` (times from ``t0``, monotonic) while ``load`` runs."""

    def __init__(self, stack: SoakStack, load: ChatLoad, faults: list[Fault], t0: float,
                 log: Callable[[str], None] = print) -> None:
        self.outcomes: list[dict] = []
        self.error: str | None = None
        self.done_s: float | None = None  # when the last fault had recovered
        self._stack, self._load, self._faults, self._t0 = stack, load, faults, t0
        self._log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finished(self) -> bool:
        return not self._thread.is_alive()

    def stop(self, timeout_s: float = RECOVERY_TIMEOUT_S * 2) -> None:
        """Apply no further fault; wait for the one under way to recover."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _run(self) -> None:
        for fault in self._faults:
            if self._stop.wait(max(0.0, fault.at_s - self._now())):
                return
            waited_s = self._wait_for_requests() if fault.kind.stops_engine else 0.0
            outcome = {"index": fault.index, "kind": fault.kind.value,
                       "planned_at_s": fault.at_s, "at_s": round(self._now(), 3),
                       "waited_for_requests_s": round(waited_s, 3), "error": None}
            try:
                outcome.update(self._apply(fault))
            except Exception as exc:  # the stack did not come back: no further faults
                outcome["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
                self.error = f"fault #{fault.index} ({fault.kind.value}): {outcome['error']}"
            outcome["ended_s"] = round(self._now(), 3)
            self.outcomes.append(outcome)
            self._log(_summary(outcome))
            if self.error:
                return
        self.done_s = self._now()

    def _wait_for_requests(self) -> float:
        """Until some request is in flight (an engine stop should hit the load), at most
        IN_FLIGHT_WAIT_S; the seconds waited."""
        started = time.monotonic()
        while (self._load.num_in_flight() == 0 and not self._stop.is_set()
               and time.monotonic() - started < IN_FLIGHT_WAIT_S):
            time.sleep(0.01)
        return time.monotonic() - started

    def _apply(self, fault: Fault) -> dict:
        handlers = {FaultKind.DAEMON_STOP: self._daemon_stop,
                    FaultKind.DAEMON_KILL: self._daemon_kill,
                    FaultKind.ENGINE_TERM: lambda f: self._engine_restart(f, signal.SIGTERM),
                    FaultKind.ENGINE_KILL: lambda f: self._engine_restart(f, signal.SIGKILL)}
        return handlers[fault.kind](fault)

    def _store_state(self) -> str | None:
        health = self._stack.engine_health(timeout_s=2.0)
        return None if health is None else health.get("kv_store")

    def _until_store(self, ok: bool, limit_s: float) -> float | None:
        """Seconds until the engine reports the store ok (``ok``) or not ok; None by
        ``limit_s``."""
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            if (self._store_state() == "ok") == ok:
                return round(time.monotonic() - started, 3)
            time.sleep(POLL_S)
        return None

    def _daemon_stop(self, fault: Fault) -> dict:
        stopped = time.monotonic()
        self._stack.signal_daemon(signal.SIGSTOP)
        try:
            flagged_s = self._until_store(False, fault.hold_s)
            time.sleep(max(0.0, fault.hold_s - (time.monotonic() - stopped)))
        finally:
            self._stack.signal_daemon(signal.SIGCONT)
        return {"hold_s": fault.hold_s, "store_flagged_after_s": flagged_s,
                "store_ok_after_cont_s": self._until_store(True, RECOVERY_TIMEOUT_S)}

    def _daemon_kill(self, fault: Fault) -> dict:
        stats = self._stack.daemon_stats() or {}
        served = {k: (stats.get("counters") or {}).get(k)
                  for k in ("lookups", "hit_blocks_dram", "hit_blocks_ssd", "miss_blocks")}
        tiers = stats.get("tiers") or {}
        served["dram_blocks"] = (tiers.get("dram") or {}).get("blocks")
        served["ssd_blocks"] = (tiers.get("ssd") or {}).get("blocks")
        self._stack.kill_daemon()
        restart_s = self._stack.start_daemon()
        return {"daemon_before_kill": served, "restart_s": round(restart_s, 3),
                "store_ok_after_restart_s": self._until_store(True, RECOVERY_TIMEOUT_S)}

    def _engine_restart(self, fault: Fault, sig: int) -> dict:
        events = self._stack.engine_offload_events()
        closed = time.monotonic()
        in_flight = self._load.pause(fault.index)
        exit_code = self._stack.stop_engine(sig)
        exit_s = time.monotonic() - closed
        listening_s, warm_s = self._stack.start_engine()
        self._load.resume(self._stack.url, self._stack.engine_incarnation)
        return {"in_flight": in_flight, "exit_code": exit_code, "exit_s": round(exit_s, 3),
                "listening_s": round(listening_s, 3), "warm_s": round(warm_s, 3),
                "gate_closed_s": round(time.monotonic() - closed, 3),
                "engine_offload_events_before": events}


def _summary(outcome: dict) -> str:
    """One log line per applied fault."""
    keys = ("hold_s", "store_flagged_after_s", "store_ok_after_cont_s", "restart_s",
            "store_ok_after_restart_s", "exit_code", "exit_s", "warm_s", "gate_closed_s")
    parts = [f"{k} {outcome[k]}" for k in keys if k in outcome]
    if "in_flight" in outcome:
        parts.append(f"in flight {len(outcome['in_flight'])}")
    if outcome["error"]:
        parts.append(f"ERROR {outcome['error'][-300:]}")
    return (f"fault #{outcome['index']} {outcome['kind']} at {outcome['at_s']:.1f} s: "
            + ", ".join(parts))
