"""stop_process: a child that ends on the signal is reaped with its status; one that ignores it
is killed after the wait; one told to end some other way is only waited for."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from kvstore.testing.processes import stop_process


def _child(code: str, **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            **kwargs)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"  # handlers are set
    return proc


def test_a_child_that_ends_on_the_signal_gives_its_status() -> None:
    # SIGINT's Python handler set in the child: a child of a background job starts with SIGINT
    # ignored, and the test then passed by the kill after 20 s, not by the signal.
    proc = _child("import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler);"
                  " print('up', flush=True); time.sleep(60)")
    status = stop_process(proc, signal.SIGINT, timeout_s=20)
    assert status not in (0, -signal.SIGKILL), status  # ended by SIGINT, not killed
    assert proc.returncode is not None


def test_a_child_that_ignores_the_signal_is_killed_after_the_wait() -> None:
    proc = _child("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('up', flush=True); time.sleep(60)")
    start = time.monotonic()
    assert stop_process(proc, timeout_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - start < 10


def test_without_a_signal_it_waits_for_the_child_to_end_by_itself() -> None:
    proc = _child("import sys; print('up', flush=True); sys.stdin.read(); sys.exit(3)",
                  stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.close()
    assert stop_process(proc, None, timeout_s=20) == 3
