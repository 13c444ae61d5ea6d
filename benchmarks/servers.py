"""The servers a benchmark starts (``kvstore serve``, ``kvengine serve``, ``kvengine router``):
a process whose output a thread drains, waited on for its ready line, and an engine's warm-up."""

from __future__ import annotations

import collections
import os
import queue
import random
import re
import signal
import subprocess
import threading
import time

import httpx

from benchmarks.workload import words_text
from kvstore.testing.processes import stop_process


class ServerProcess:
    """A subprocess whose merged output is drained by a thread (last lines kept)."""

    def __init__(self, cmd: list[str], name: str, keep: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        """``env``: variables set for the process over this one's."""
        self.cmd = cmd
        self.name = name
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.error_lines: list[str] = []  # every ERROR or CRITICAL log line, kept in full
        self._keep = re.compile(keep) if keep else None
        self.kept: list[str] = []  # every line matching ``keep``, in full
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **env} if env else None)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if " ERROR " in line or " CRITICAL " in line:
                self.error_lines.append(line.rstrip("\n"))
            if self._keep is not None and self._keep.search(line):
                self.kept.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first output line matching `pattern`; RuntimeError on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"{self.name} not ready after {timeout_s:g} s:\n"
                                   + "\n".join(self.lines)) from None
            if line is None:
                raise RuntimeError(f"{self.name} exited with {self.proc.wait()}:\n"
                                   + "\n".join(self.lines))
            match = re.search(pattern, line)
            if match:
                return match

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        stop_process(self.proc, sig, timeout_s)


def warm_up(url: str, max_tokens: int, tokens_per_word: float, length: int) -> None:
    """Two requests on text no user sends: kernels compiled, prefill rate measured."""
    rng = random.Random("warm-up")
    with httpx.Client(timeout=600) as client:
        for num_tokens in (16, length):
            body = {"messages": [{"role": "user",
                                  "content": words_text(rng, num_tokens, tokens_per_word)}],
                    "max_tokens": max_tokens, "temperature": 0.0}
            client.post(url + "/v1/chat/completions", json=body).raise_for_status()
