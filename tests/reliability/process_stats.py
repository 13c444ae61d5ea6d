"""What a daemon process costs, read from /proc: resident memory and CPU time."""

from __future__ import annotations

import os
import threading
import time


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Samples a process's RSS on a thread; ``peak`` is the largest seen. ``kill_above`` bytes
    (optional) kills the process: a run that would eat the machine stops there, and fails."""

    def __init__(self, pid: int, interval_s: float = 0.02, kill_above: int | None = None) -> None:
        self.pid = pid
        self.peak = 0
        self.killed = False
        self._interval_s = interval_s
        self._kill_above = kill_above
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = rss_bytes(self.pid)
            except (OSError, RuntimeError):
                return
            self.peak = max(self.peak, rss)
            if self._kill_above is not None and rss > self._kill_above:
                self.killed = True
                os.kill(self.pid, 9)
                return
            time.sleep(self._interval_s)
