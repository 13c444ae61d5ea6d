"""A real `kvengine router` subprocess for tests: started, waited for until it listens.

`python -m server.cli router MODEL_DIR --port 0 ARGS`, its URL read from the "listening on"
line; stderr drained by a thread into ``lines`` for as long as it runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from support.kvengine import CLI, REPO_ROOT

_LISTENING = re.compile(r"listening on (http://\S+)")


def start_router(model_dir: Path, args: Sequence[str],
                 lines: list[str]) -> tuple[subprocess.Popen, str]:
    """The router process and its URL (RuntimeError when it does not start within 60 s)."""
    proc = subprocess.Popen([*CLI, "router", str(model_dir), "--port", "0", *args],
                            cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "KVENGINE_API_KEY"})
    found = threading.Event()
    url: list[str] = []

    def pump() -> None:
        for line in proc.stderr:
            lines.append(line)
            match = _LISTENING.search(line)
            if match and not url:
                url.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(60) or not url:
        proc.kill()
        raise RuntimeError("kvengine router did not start:\n" + "".join(lines[-30:]))
    return proc, url[0]


def stop_router(proc: subprocess.Popen) -> None:
    """SIGINT, then SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
