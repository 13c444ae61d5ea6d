"""``--log-format json`` (issue 30 item 6): every line both programs write is one JSON object,
the start-up lines included; ``text`` keeps them as before. Real processes; a daemon that cannot
use its socket folder says so before it faults its DRAM pool in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore.testing.processes import stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("KVSTORE_", "KVENGINE_"))}


def _lines_until(proc: subprocess.Popen, needle: str, timeout_s: float = 90.0) -> list[str]:
    """Lines of the merged output until one holds ``needle``; the process is stopped."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if needle in line or time.monotonic() > deadline:
                break
    finally:
        stop_process(proc, signal.SIGTERM)
        lines += [line.rstrip("\n") for line in proc.stdout]
    return [line for line in lines if line]


def _all_json(lines: list[str]) -> list[dict]:
    records = []
    for line in lines:
        record = json.loads(line)  # raises on any line that is not JSON
        assert {"time", "level", "logger", "message"} <= set(record), record
        records.append(record)
    return records


def test_kvstore_serve_json_lines() -> None:
    sock = Path(tempfile.mkdtemp(prefix="kvs-")) / "kvstore.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(sock),
                             "--dram", "8Mi", "--http", "127.0.0.1:0", "--log-format", "json",
                             "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, env=_env())
    records = _all_json(_lines_until(proc, "kvstore: ready"))
    messages = [r["message"] for r in records]
    assert any(m.startswith("kvstore: ready (pid") for m in messages), messages
    assert any(m.startswith("kvstore: DRAM pool") for m in messages)
    assert "kvstore: stopped" in messages


def test_kvstore_serve_text_lines_stay_as_they_were() -> None:
    sock = Path(tempfile.mkdtemp(prefix="kvs-")) / "kvstore.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(sock),
                             "--dram", "8Mi", "--http", "off"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, env=_env())
    lines = _lines_until(proc, "kvstore: ready")
    assert f"kvstore: ready (pid {proc.pid})" in lines and "kvstore: stopped" in lines


def test_kvengine_serve_json_lines(tiny_model_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", str(tiny_model_dir),
                             "--device", "cpu", "--port", "0", "--log-format", "json",
                             "--log-level", "info", "--uvicorn-log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, env=_env())
    records = _all_json(_lines_until(proc, "listening on"))
    messages = [r["message"] for r in records]
    assert any("kvengine: loading" in m for m in messages), messages
    assert any("listening on http://" in m for m in messages), messages
    assert {"kvengine.banner", "engine"} <= {r["logger"] for r in records}


def test_a_bad_socket_folder_is_refused_before_the_pool() -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvs-"))
    folder.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                          str(folder / "kvstore.sock"), "--dram", "8Mi", "--http", "off"],
                         capture_output=True, text=True, cwd=REPO_ROOT, env=_env(), timeout=60)
    assert out.returncode == 1
    assert "mode 0755" in out.stderr
    assert "allocating" not in out.stdout  # nothing was faulted in first
