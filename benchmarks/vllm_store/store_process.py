"""A ``kvstore serve`` on a fresh socket for the vLLM benchmarks (the vLLM process itself is
``kvstore.testing.vllm_process``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from kvstore.testing.processes import stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]


def start_store(dram: str = "1GiB", preamble: str = "", flags: Sequence[str] = (),
                switch_interval_s: float | None = None) -> tuple[subprocess.Popen, Path]:
    """A ``kvstore serve`` on a fresh socket for a benchmark; returns once it is ready.

    ``flags``: more ``kvstore serve`` options (a benchmark variant's ``--copy-*`` tuning).
    ``preamble``: Python run in the daemon before it starts (instrumentation, e.g.
    ``benchmarks.copy_trace``'s hooks). ``switch_interval_s``: the GIL switch interval the
    daemon serves under (None: its own, ``kvstore.cli.serve.SERVE_SWITCH_INTERVAL_S``)."""
    import tempfile

    socket_path = Path(tempfile.mkdtemp(prefix="kvs-vllm-")) / "kvstore.sock"
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_SOCKET"}
    head = [sys.executable, "-m", "kvstore.cli"]
    if preamble or switch_interval_s is not None:
        tuning = "" if switch_interval_s is None else f", switch_interval_s={switch_interval_s!r}"
        code = ["import sys", preamble, "from kvstore.cli import main",
                f"sys.exit(main(sys.argv[1:]{tuning}))"]
        head = [sys.executable, "-c", "; ".join(line for line in code if line)]
    proc = subprocess.Popen([*head, "serve", "--socket",
                             str(socket_path), "--dram", dram, "--http", "off", *flags],
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

    stop_process(proc, timeout_s=30)
    shutil.rmtree(socket_path.parent, ignore_errors=True)
