"""A real `kvengine serve` subprocess for tests: started, waited for until it listens, stopped.

The one place tests start the engine's server: `python -m server.cli serve --device cpu --port 0
ARGS` (ARGS come last, so they may override either), its URL read from the "listening on" line.
Its stderr is drained by a thread for as long as it runs, so a chatty server never blocks on a
full pipe, and every line is kept for the test to read.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from kvstore.testing.processes import stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "server.cli")
_LISTENING = re.compile(r"listening on (http://\S+)")


def child_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``env`` on top; a ``None`` value removes that variable."""
    out = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


class KvengineProcess:
    """`kvengine serve --device cpu --port 0 *args`, listening once the constructor returns
    (RuntimeError with its last lines if it exits or does not listen in ``ready_timeout_s``).

    ``env``: variables over this process's (``None`` removes one); ``max_open_files``: the
    child's RLIMIT_NOFILE (soft and hard). Stops on ``stop()`` or when a ``with`` block ends.
    """

    def __init__(self, *args: str, env: Mapping[str, str | None] | None = None,
                 ready_timeout_s: float = 90.0, max_open_files: int | None = None) -> None:
        def limit_files() -> None:
            if max_open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

        self.proc = subprocess.Popen([*CLI, "serve", "--device", "cpu", "--port", "0", *args],
                                     cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
                                     env=child_env(env), preexec_fn=limit_files)
        self.lines: list[str] = []
        self.url = ""
        self.ready_line = ""  # the "listening on URL" line
        self._listening = threading.Event()
        self._pump = threading.Thread(target=self._read_stderr, daemon=True)
        self._pump.start()
        if not self._listening.wait(ready_timeout_s) or not self.url:
            self.stop(signal.SIGKILL)
            raise RuntimeError("kvengine serve did not start:\n" + self.tail())

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if not self.url and (match := _LISTENING.search(line)):
                self.url, self.ready_line = match.group(1), line
                self._listening.set()
        self._listening.set()  # exited: the constructor stops waiting

    def tail(self, num_lines: int = 40) -> str:
        """The last lines of its stderr."""
        return "".join(self.lines[-num_lines:])

    @property
    def stderr_bytes(self) -> int:
        """Bytes the server wrote to stderr so far."""
        return sum(len(line) for line in self.lines)

    def rss_bytes(self) -> int:
        """The server's resident set size now."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def health_s(self, timeout_s: float = 30.0) -> float:
        """Seconds one fresh client waited for /health (which must answer 200)."""
        start = time.perf_counter()
        response = httpx.get(self.url + "/health", timeout=timeout_s)
        assert response.status_code == 200, response.text
        return time.perf_counter() - start

    def num_open_fds(self) -> int:
        """File descriptors the server holds now."""
        return len(list(Path(f"/proc/{self.proc.pid}/fd").iterdir()))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        """Send ``sig`` (SIGKILL past ``timeout_s``) and wait; its exit status."""
        returncode = stop_process(self.proc, sig, timeout_s)
        self._pump.join(5)
        return returncode

    def __enter__(self) -> KvengineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_kvengine(args: Sequence[str], env: Mapping[str, str | None] | None = None,
                 timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    """`kvengine ARGS` to completion (for the commands that must fail, and --help)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s,
                          cwd=REPO_ROOT, env=child_env(env))
