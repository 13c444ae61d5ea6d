"""`kvstore demo` runs end to end on CPU and shows turns served from the store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_restores_from_the_store(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--device", "cpu", "--users", "3",
         "--turns", "4", "--cache-dir", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    restart_rows = [line for line in lines if line.strip().startswith("restart")]
    assert len(restart_rows) == 3
    assert all("dram:" in row or "ssd:" in row for row in restart_rows)  # a fresh engine's HBM
    assert "mean TTFT" in proc.stdout


def test_demo_rejects_bad_flags(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--users", "0", "--cache-dir",
         str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--users" in proc.stderr
