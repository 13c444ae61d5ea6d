"""Issue 21 item 10: an ``--ssd-size`` larger than the filesystem used to be accepted (a sparse
file, a banner with the asked size, then ENOSPC at every demotion). Now the daemon refuses at
start with one line: the filesystem's free space, what the tier already holds, the asked size.
A restart of a tier whose files already fill most of the disk is not refused."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from daemon_helpers import REPO_ROOT
from readonly_disk import ext4_mount


def _serve(ssd_dir: Path, ssd_size: str, timeout_s: float = 15.0) -> tuple[int | None, str]:
    """Start `kvstore serve`; (exit status, or None if it got ready and was stopped; output)."""
    socket_path = Path(tempfile.mkdtemp(prefix="kvs-")) / "kvstore.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(socket_path),
         "--dram", "16MiB", "--http", "off", "--ssd-dir", str(ssd_dir), "--ssd-size", ssd_size],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
        return None, out


def test_ssd_size_beyond_the_filesystem_is_refused(tmp_path: Path) -> None:
    with ext4_mount(tmp_path, size_mib=64) as mnt:
        rc, out = _serve(mnt / "ssd", "512MiB")
        assert rc not in (None, 0), f"a 512 MiB tier started on a 64 MiB filesystem:\n{out}"
        errors = [line for line in out.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in out, out
        line = errors[0]
        assert "512" in line and "free" in line and "already hold" in line, line
        assert not list((mnt / "ssd").glob("data-*.bin")), "files were made before refusing"


def test_a_tier_that_fits_restarts_over_its_own_files(tmp_path: Path) -> None:
    with ext4_mount(tmp_path, size_mib=64) as mnt:
        # 40 MiB preallocated out of ~58 MiB free: a second start finds less than 40 MiB free,
        # but its own files hold the rest.
        for _ in range(2):
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                 str(Path(tempfile.mkdtemp(prefix="kvs-")) / "kvstore.sock"), "--dram", "16MiB",
                 "--http", "off", "--ssd-dir", str(mnt / "ssd"), "--ssd-size", "40MiB"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "kvstore: ready" in line or "error" in line:
                    break
            proc.terminate()
            rest, _ = proc.communicate(timeout=20)
            assert proc.returncode == 0, "".join(lines) + rest
            assert any("SSD tier" in line and "40.0 MiB" in line for line in lines), lines
