"""A `kvengine serve` subprocess for tests: started, waited for, stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

CLI = [sys.executable, "-m", "server.cli"]


@dataclass
class ServeProcess:
    url: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)


@contextmanager
def kvengine_serve(args: list[str], env: dict[str, str] | None = None,
                   start_timeout_s: float = 90.0) -> Iterator[ServeProcess]:
    """`kvengine serve ARGS --device cpu --port 0` until its "listening on" line; SIGINT after."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(CLI + ["serve", *args, "--device", "cpu", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=full_env)
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + start_timeout_s
        url = None
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert url is not None, "".join(lines)
        yield ServeProcess(url, proc, lines)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def run_kvengine(args: list[str], env: dict[str, str] | None = None,
                 timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    """`kvengine ARGS` to completion (for the commands that must fail)."""
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})
