"""A `kvstore serve` subprocess for a benchmark: started on a fresh socket with the flags a
benchmark compares, optionally traced or profiled, its output echoed, stopped bounded.

Used by ``transfer_daemon`` and ``hbm_copy``; a benchmark only (tests start theirs through
``tests/daemon_helpers.py``).
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from kvstore.testing.processes import stop_process

# --trace: the daemon runs with benchmarks/copy_trace.py's hooks installed first.
_TRACED_SERVE = ("import sys, benchmarks.copy_trace as ct; ct.install({!r}); "
                 "from kvstore.cli import main; sys.exit(main(sys.argv[1:]))")
# request_trace: with benchmarks/request_trace.py's stage stamps installed first.
_REQUEST_TRACED_SERVE = ("import sys, benchmarks.request_trace as rt; rt.install({!r}); "
                         "from kvstore.cli import main; sys.exit(main(sys.argv[1:]))")
_PROFILED_SERVE = ("import sys, benchmarks.stack_sampler as ss; ss.install({!r}); "
                   "from kvstore.cli import main; sys.exit(main(sys.argv[1:]))")


def start_daemon(dram_bytes: int, flags: Sequence[str] = (), trace: Path | None = None,
                 profile: Path | None = None, request_trace: Path | None = None,
                 tree: Path | None = None) -> tuple[subprocess.Popen, Path]:
    """A ready daemon on a fresh socket (its process and socket path), started with more
    ``kvstore serve`` ``flags``; ``trace``: a timeline of every save/load into this file
    (benchmarks/copy_trace.py); ``profile``: the daemon's sampled stacks into this file
    (benchmarks/stack_sampler.py); ``request_trace``: each request's stages into this file
    (benchmarks/request_trace.py, the tree's own); ``tree``: the daemon of another checkout
    (an older tree, for a before/after in one run), run from its folder."""
    socket_path = Path(tempfile.mkdtemp(prefix="kvs-bench-")) / "kvstore.sock"
    head = [sys.executable, "-m", "kvstore.cli"]
    if trace is not None:
        head = [sys.executable, "-c", _TRACED_SERVE.format(str(trace))]
    elif profile is not None:
        head = [sys.executable, "-c", _PROFILED_SERVE.format(str(profile))]
    elif request_trace is not None:
        head = [sys.executable, "-c", _REQUEST_TRACED_SERVE.format(str(request_trace))]
    proc = subprocess.Popen([*head, "serve", "--socket", str(socket_path), "--dram",
                             str(dram_bytes), "--http", "off", *flags],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=_daemon_env(tree), cwd=tree)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            sys.stdout.write("  daemon| " + line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        line = lines.get(timeout=120)
        if line is None:
            raise RuntimeError(f"daemon exited with {proc.wait()}")
        if "kvstore: ready" in line:
            return proc, socket_path


def _daemon_env(tree: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_SOCKET"}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def stop_daemon(proc: subprocess.Popen, socket_path: Path) -> None:
    """Stop it (bounded) and remove its socket's folder."""
    stop_process(proc, timeout_s=60)
    shutil.rmtree(socket_path.parent, ignore_errors=True)
