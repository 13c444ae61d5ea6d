"""Stopping a child process that tests and benchmarks started: ask, wait, then kill."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, sig: int | None = signal.SIGTERM,
                 timeout_s: float = 20.0, kill_wait_s: float = 10.0) -> int:
    """Send ``sig`` (None: send nothing, the caller has told it to end, e.g. by closing its
    stdin), wait up to ``timeout_s``, then SIGKILL and wait up to ``kill_wait_s``; its exit
    status. A process that has already ended is only reaped."""
    if proc.poll() is None:
        if sig is not None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(kill_wait_s)
    return proc.returncode
