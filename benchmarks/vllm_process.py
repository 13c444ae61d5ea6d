"""A ``kvstore serve`` on a fresh socket for the vLLM benchmarks (the vLLM process itself is
``kvstore.testing.vllm_process``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def start_store(dram: str = "1GiB", preamble: str = "") -> tuple[subprocess.Popen, Path]:
    """A ``kvstore serve`` on a fresh socket for a benchmark; returns once it is ready.

    ``preamble``: Python run in the daemon before it starts (a benchmark variant setting module
    constants, e.g. ``import kvstore.engines.copier as c; c.SMALL_RUNS = 'kernel'``)."""
    import tempfile

    socket_path = Path(tempfile.mkdtemp(prefix="kvs-vllm-")) / "kvstore.sock"
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_SOCKET"}
    head = [sys.executable, "-c", f"import sys; {preamble}; from kvstore.cli import main; "
            "sys.exit(main(sys.argv[1:]))"] if preamble else [sys.executable, "-m", "kvstore.cli"]
    proc = subprocess.Popen([*head, "serve", "--socket",
                             str(socket_path), "--dram", dram, "--http", "off"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "kvstore: ready" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it drained
            return proc, socket_path
    raise RuntimeError(f"kvstore serve exited with {proc.wait()}")


def stop_store(proc: subprocess.Popen, socket_path: Path) -> None:
    import shutil

    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    shutil.rmtree(socket_path.parent, ignore_errors=True)
