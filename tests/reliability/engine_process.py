"""A real `kvengine serve` process on a tiny CPU model, for the HTTP attack tests: its URL, its
RSS, its stderr, and a stop that always happens."""

from __future__ import annotations

import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from engine.make_model import write_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]


def tiny_model(folder: Path) -> Path:
    """A tiny random-weight model folder (written once per folder)."""
    if not (folder / "config.json").is_file():
        write_checkpoint(folder, "tiny", seed=0)
    return folder


class EngineProcess:
    """`python -m server.cli serve --model MODEL --device cpu --port 0 *args`, started and ready.

    `max_open_files` sets the child's RLIMIT_NOFILE (soft and hard) before it starts.
    """

    def __init__(self, model_dir: Path, *args: str, max_open_files: int | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 90.0) -> None:
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir),
               "--device", "cpu", "--port", "0", "--num-kv-blocks", "128", *args]

        def limit_files() -> None:
            if max_open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
                                     env=env, preexec_fn=limit_files)
        self.lines: list[str] = []
        self._url_found = threading.Event()
        self.url = ""
        self._pump = threading.Thread(target=self._read_stderr, daemon=True)
        self._pump.start()
        if not self._url_found.wait(ready_timeout_s):
            self.stop()
            raise RuntimeError("kvengine did not start:\n" + "".join(self.lines[-40:]))

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                self._url_found.set()
        self._url_found.set()

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

    def num_open_fds(self) -> int:
        """File descriptors the server holds now."""
        return len(list(Path(f"/proc/{self.proc.pid}/fd").iterdir()))

    def health_s(self, timeout_s: float = 30.0) -> float:
        """Seconds one fresh client waited for /health (which must answer 200)."""
        start = time.perf_counter()
        response = httpx.get(self.url + "/health", timeout=timeout_s)
        assert response.status_code == 200, response.text
        return time.perf_counter() - start

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._pump.join(5)


class HealthWatch:
    """Polls /health from a thread with fresh connections; `worst_s` is the longest wait."""

    def __init__(self, url: str, interval_s: float = 0.05, timeout_s: float = 60.0) -> None:
        self._url = url
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self.waits_s: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self._timeout_s + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                status = httpx.get(self._url + "/health", timeout=self._timeout_s).status_code
                if status != 200:
                    self.failures.append(f"status {status}")
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self.waits_s.append(time.perf_counter() - start)
            self._stop.wait(self._interval_s)

    @property
    def worst_s(self) -> float:
        return max(self.waits_s, default=0.0)
