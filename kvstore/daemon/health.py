"""What the daemon's probes report: the control loop's heartbeat, the SSD tier's state and Redis's,
read by the admin thread (``/health``, ``/ready``, ``/metrics``) without asking the loop.

The admin app runs on its own thread, so it answers while the control loop is wedged; it must not
answer "ok" then. The loop ticks a ``LoopHeartbeat`` every ``interval_s``; a last tick older than
``stall_after_s`` is a stalled loop: status ``failing`` (HTTP 503), since clients' requests are not
being answered. A read-only or failing SSD, or Redis down with ``--cluster``, leaves the daemon
serving (from DRAM, locally): status ``degraded`` (HTTP 200), each with its reason. A liveness
probe restarts on 503; a restart fixes a wedged loop, not a disk or Redis. A sticky CUDA error
(``kvstore.engines.cuda_fault``) is ``failing`` too: the daemon exits on its own soon after.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.daemon.stalls import Stalls
from kvstore.store.ssd.files import data_file_path

if TYPE_CHECKING:
    from kvstore.daemon.service import Service

# SSD counters that mean IO failed; an increase within the window marks the tier failing.
_SSD_ERROR_COUNTERS = ("write_errors", "read_errors", "index_commit_failures")
SSD_ERROR_WINDOW_S = 60.0


class Status(str, Enum):
    OK = "ok"
    DEGRADED = "degraded"  # serving, with a tier or the cluster index out
    FAILING = "failing"  # not serving its clients (a stalled loop, a poisoned CUDA context)


class LoopState(str, Enum):
    STARTING = "starting"  # the loop has not ticked yet
    OK = "ok"
    STALLED = "stalled"  # no tick for stall_after_s: a blocking call on the loop, or worse
    STOPPING = "stopping"


class SsdState(str, Enum):
    OFF = "off"
    OK = "ok"
    READ_ONLY = "read_only"  # the filesystem is mounted read-only, or a write met EROFS
    FAILING = "failing"  # IO errors within the last SSD_ERROR_WINDOW_S
    DAMAGED = "damaged"  # a data file is shorter than laid out (truncated, deleted)


class CudaState(str, Enum):
    OK = "ok"  # no GPU, or no sticky error seen
    POISONED = "poisoned"  # a sticky CUDA error: no copy runs; the daemon exits for a restart


class RedisState(str, Enum):
    OFF = "off"  # no --cluster
    UP = "up"
    DOWN = "down"


class LoopHeartbeat:
    """Ticked by a task on the control loop (``run``); read from any thread."""

    def __init__(self, interval_s: float = 0.1, stall_after_s: float = 0.5,
                 stalls: Stalls | None = None) -> None:
        """``stalls``: told how late each tick ran."""
        if not 0 < interval_s < stall_after_s:
            raise ValueError("the heartbeat must tick more often than stall_after_s")
        self.interval_s = interval_s
        self.stall_after_s = stall_after_s
        self.stalls = stalls if stalls is not None else Stalls()
        self._last_tick: float | None = None
        self._stopping = False

    async def run(self) -> None:
        """Tick until cancelled (the daemon's shutdown), then say stopping."""
        try:
            while True:
                now = time.monotonic()
                if self._last_tick is not None:
                    self.stalls.loop_ticked(max(0.0, now - self._last_tick - self.interval_s))
                self._last_tick = now
                await asyncio.sleep(self.interval_s)
        finally:
            self._stopping = True

    def stop(self) -> None:
        """The daemon is shutting down: no longer ready, whatever the loop does meanwhile."""
        self._stopping = True

    def age_s(self) -> float | None:
        """Seconds since the last tick; None before the first."""
        last = self._last_tick
        return None if last is None else max(0.0, time.monotonic() - last)

    def state(self) -> LoopState:
        age = self.age_s()
        if self._stopping:
            return LoopState.STOPPING
        if age is None:
            return LoopState.STARTING
        return LoopState.STALLED if age > self.stall_after_s else LoopState.OK


@dataclass(frozen=True)
class Check:
    """One component's state and, when not fine, why."""

    state: str
    reason: str = ""


PROBE_FILE = ".kvstore-health-probe"


class SsdWatch:
    """The SSD tier's state from its stats and its filesystem: a read-only filesystem shows
    before any write meets it, by ``statvfs`` (``mount -o remount,ro``) and by opening a probe
    file for writing (ext4's ``errors=remount-ro`` refuses that with EROFS, while ``statvfs``
    may still say read-write)."""

    def __init__(self, ssd_dir: Path | None) -> None:
        self.ssd_dir = ssd_dir
        self._errors_seen = -1
        self._last_error_at: float | None = None

    def check(self, ssd_stats: dict) -> Check:
        if self.ssd_dir is None or not ssd_stats.get("enabled", True):
            return Check(SsdState.OFF.value)
        try:
            if os.statvfs(self.ssd_dir).f_flag & os.ST_RDONLY:
                return Check(SsdState.READ_ONLY.value, f"{self.ssd_dir} is mounted read-only")
            os.close(os.open(self.ssd_dir / PROBE_FILE, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC,
                             0o600))
        except OSError as exc:
            if exc.errno == errno.EROFS:
                return Check(SsdState.READ_ONLY.value, f"{self.ssd_dir} is read-only")
            return Check(SsdState.FAILING.value, f"{self.ssd_dir}: {exc.strerror or exc}")
        if ssd_stats.get("read_only"):
            return Check(SsdState.READ_ONLY.value, f"writes under {self.ssd_dir} met EROFS")
        damaged = self._short_file(int(ssd_stats.get("files", 0)),
                                   int(ssd_stats.get("file_bytes", 0)))
        if damaged is not None:
            return Check(SsdState.DAMAGED.value, damaged)
        counters = ssd_stats.get("counters") or {}
        errors = sum(int(counters.get(name, 0)) for name in _SSD_ERROR_COUNTERS)
        now = time.monotonic()
        if self._errors_seen >= 0 and errors > self._errors_seen:
            self._last_error_at = now
        self._errors_seen = errors
        if self._last_error_at is not None and now - self._last_error_at < SSD_ERROR_WINDOW_S:
            return Check(SsdState.FAILING.value, f"IO errors within the last "
                         f"{SSD_ERROR_WINDOW_S:.0f} s ({errors} in all)")
        return Check(SsdState.OK.value)


    def _short_file(self, num_files: int, file_bytes: int) -> str | None:
        """Why a data file is not the size the tier laid it out at (blocks in it past its end
        are gone: their reads miss), or None."""
        assert self.ssd_dir is not None
        for i in range(num_files):
            path = data_file_path(self.ssd_dir, i)
            try:
                size = path.stat().st_size
            except OSError as exc:
                return f"{path}: {exc.strerror or exc}"
            if size < file_bytes:
                return f"{path} holds {size} bytes of its {file_bytes}: truncated"
        return None


class DaemonHealth:
    """The probes' answers over one Service; ``heartbeat`` is None for an app without a loop
    (its loop is then reported as starting)."""

    def __init__(self, service: Service, heartbeat: LoopHeartbeat | None = None,
                 ssd_dir: Path | None = None) -> None:
        self.service = service
        self.heartbeat = heartbeat
        self._ssd = SsdWatch(ssd_dir)

    def _loop(self) -> tuple[Check, float | None]:
        if self.heartbeat is None:
            return Check(LoopState.STARTING.value, "no control loop attached"), None
        age = self.heartbeat.age_s()
        state = self.heartbeat.state()
        reason = f"no tick for {age:.2f} s" if state is LoopState.STALLED and age else ""
        return Check(state.value, reason), age

    def _redis(self) -> Check:
        node = self.service.cluster
        if node is None:
            return Check(RedisState.OFF.value)
        index = node.index
        if index is None:
            return Check(RedisState.DOWN.value, "the cluster index is not running")
        why = index.probe()  # one PING, bounded by the index's Redis timeout
        if why is not None:
            return Check(RedisState.DOWN.value, why)
        if not index.up:
            return Check(RedisState.DOWN.value, "Redis answers; the index is reconnecting")
        return Check(RedisState.UP.value)

    def report(self) -> dict[str, Any]:
        """``/health``'s body: the overall status, each component's state and the reasons."""
        loop, age = self._loop()
        ssd = self._ssd.check(((self.service.store.stats().get("tiers") or {}).get("ssd")) or {})
        redis_check = self._redis()
        cuda = self._cuda()
        problems = [f"{name}: {check.state}" + (f" ({check.reason})" if check.reason else "")
                    for name, check, fine in (
                        ("control loop", loop, (LoopState.OK.value, LoopState.STARTING.value)),
                        ("ssd", ssd, (SsdState.OK.value, SsdState.OFF.value)),
                        ("redis", redis_check, (RedisState.UP.value, RedisState.OFF.value)),
                        ("cuda", cuda, (CudaState.OK.value,)))
                    if check.state not in fine]
        if loop.state in (LoopState.STALLED.value, LoopState.STOPPING.value) or \
                cuda.state == CudaState.POISONED.value:
            status = Status.FAILING
        else:
            status = Status.DEGRADED if problems else Status.OK
        return {**self.service.health(), "status": status.value,
                "control_loop": {"state": loop.state,
                                 "last_tick_age_s": None if age is None else round(age, 3)},
                "ssd": {"state": ssd.state, "reason": ssd.reason},
                "redis": {"state": redis_check.state, "reason": redis_check.reason},
                "cuda": {"state": cuda.state, "reason": cuda.reason},
                "problems": problems}

    def _cuda(self) -> Check:
        reason = self.service.registry.cuda_fault.reason
        if reason is None:
            return Check(CudaState.OK.value)
        return Check(CudaState.POISONED.value, reason)

    def ready(self) -> tuple[bool, str]:
        """Serving: the store is open and the control loop ticks."""
        if self.heartbeat is None:
            return False, "no control loop attached"
        state = self.heartbeat.state()
        if state is not LoopState.OK:
            return False, f"control loop {state.value}"
        cuda = self._cuda()
        if cuda.state != CudaState.OK.value:
            return False, f"CUDA context {cuda.state} ({cuda.reason})"
        return True, "serving"
