"""kvstore.process_guard: a non-dumpable process's memfd cannot be opened through /proc by
another process of the same user; a dumpable one's can (what --dumpable keeps). Real processes
under an unprivileged uid (root may open anything, so the test needs root to drop to one), run
by the system's python3 on a copy of the module (the unprivileged uid may not read this venv)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
HOLDER = """
import os, sys, time
fd = os.memfd_create("kvengine-arena")
os.ftruncate(fd, 4096)
if sys.argv[1] == "guarded":
    from process_guard import forbid_inspection, is_dumpable
    forbid_inspection()
    assert not is_dumpable()
print(fd, flush=True)
time.sleep(60)
"""
OPENER = """
import sys
try:
    open(sys.argv[1], "r+b").close()
    print("opened")
except PermissionError:
    print("refused")
"""

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")]


def _opened_by_same_uid(mode: str) -> str:
    if os.geteuid() != 0 or SYSTEM_PYTHON is None:
        pytest.skip("needs root (to run as another uid) and a system python3")
    module = Path(tempfile.mkdtemp(prefix="kv-guard-", dir="/tmp"))  # pytest's are root's only
    shutil.copy(REPO_ROOT / "kvstore" / "process_guard.py", module / "process_guard.py")
    for path in (module, module / "process_guard.py"):
        path.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(module)}
    holder = subprocess.Popen([SYSTEM_PYTHON, "-c", HOLDER, mode], user=NOBODY, group=NOBODY,
                              stdout=subprocess.PIPE, text=True, cwd="/", env=env)
    try:
        fd = int(holder.stdout.readline())
        opener = subprocess.run([SYSTEM_PYTHON, "-c", OPENER, f"/proc/{holder.pid}/fd/{fd}"],
                                user=NOBODY, group=NOBODY, capture_output=True, text=True,
                                cwd="/", env=env, timeout=30)
        assert opener.returncode == 0, opener.stderr
        return opener.stdout.strip()
    finally:
        holder.kill()
        holder.wait()
        shutil.rmtree(module, ignore_errors=True)


def test_a_guarded_process_arena_is_closed_to_its_own_user() -> None:
    assert _opened_by_same_uid("dumpable") == "opened"  # what the guard is for
    assert _opened_by_same_uid("guarded") == "refused"


def test_the_guard_in_a_child_of_this_process() -> None:
    child = subprocess.run([sys.executable, "-c", "from kvstore.process_guard import "
                            "forbid_inspection, is_dumpable; assert is_dumpable(); "
                            "forbid_inspection(); assert not is_dumpable()"],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert child.returncode == 0, child.stderr
