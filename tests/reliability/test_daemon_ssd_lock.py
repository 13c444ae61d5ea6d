"""Issue 21 item 11: deleting ``ssd/LOCK`` must not let a second daemon open the same SSD
directory. The first daemon holds an OS lock for its lifetime; the second refuses with one line
naming the holder's pid."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from daemon_helpers import REPO_ROOT, RunningDaemon


def test_second_daemon_refused_after_lock_file_deleted(make_daemon, tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    first: RunningDaemon = make_daemon(ssd_dir=ssd_dir, ssd_size="16MiB")
    with first.client() as c:
        c.put(b"k", b"v" * 4096)
    (ssd_dir / "LOCK").unlink()  # what the attack did

    socket_path = Path(tempfile.mkdtemp(prefix="kvs-")) / "kvstore.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(socket_path),
         "--dram", "16MiB", "--http", "off", "--ssd-dir", str(ssd_dir), "--ssd-size", "16MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:  # it is serving the directory the first one holds
        proc.kill()
        stdout, stderr = proc.communicate()
    second = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert second.returncode not in (0, -9), "a second daemon served the same SSD directory"
    # one line says why (after the start-up line that it is allocating its pool)
    errors = [line for line in second.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, second.stderr
    assert f"pid {first.proc.pid}" in errors[0] and str(ssd_dir) in errors[0], errors[0]
    assert "Traceback" not in second.stderr
    # The first daemon never noticed: it still serves what it stored.
    with first.client() as c:
        assert c.get(b"k") == b"v" * 4096
