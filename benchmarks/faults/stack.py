"""The processes a fault soak runs and hurts: one ``kvstore serve`` and one ``kvengine serve``.

The daemon always lives on the same socket and SSD folder, so a restarted daemon is the one the
engine reconnects to and the SSD tier's blocks survive it. Every start is timed: to ``ready``
(daemon) or to listening plus warm-up (engine). Each start is an incarnation, counted, so a
request can say which engine served it. ``reference_engine`` starts the engine the answers are
compared against: the same model and device, no ``--kv-offload``, no prefix cache.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.servers import ServerProcess

# kvengine:kv_offload_events_total{event="blocks_saved",model_name="m"} 12.0
_EVENTS = "kvengine:kv_offload_events_total"
_ALLOCATOR = "kvengine:gpu_allocator_bytes"
MODEL_NAME = "soak"  # what the engines serve the model as


@dataclass(frozen=True)
class StackConfig:
    """How the daemon and the engines start (sizes in bytes; ``ssd_bytes`` 0: no SSD tier)."""

    model_dir: Path
    device: str
    workdir: Path
    dram_bytes: int
    ssd_bytes: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    block_size: int = 16
    start_timeout_s: float = 600.0
    engine_args: tuple[str, ...] = ()

    @property
    def socket_path(self) -> Path:
        return self.workdir / "kv.sock"


class SoakStack:
    """The daemon and the engine under test; ``warm_up(url)`` runs after every engine start."""

    def __init__(self, config: StackConfig, warm_up: Callable[[str], None]) -> None:
        self.config = config
        self._warm_up = warm_up
        self.daemon: ServerProcess | None = None
        self.engine: ServerProcess | None = None
        self.url = ""
        self.daemon_incarnation = 0
        self.engine_incarnation = 0

    # -- the daemon ----------------------------------------------------------------------------
    def start_daemon(self) -> float:
        """Start a daemon on the socket; seconds until it said ready."""
        c = self.config
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(c.socket_path),
               "--dram", str(c.dram_bytes), "--http", "off"]
        if c.ssd_bytes:
            cmd += ["--ssd-dir", str(c.workdir / "ssd"), "--ssd-size", str(c.ssd_bytes)]
        started = time.monotonic()
        self.daemon = ServerProcess(cmd, "kvstore serve")
        self.daemon.wait_for(r"kvstore: ready", c.start_timeout_s)
        self.daemon_incarnation += 1
        return time.monotonic() - started

    def signal_daemon(self, sig: int) -> None:
        assert self.daemon is not None
        os.kill(self.daemon.proc.pid, sig)

    def kill_daemon(self) -> None:
        """SIGKILL, reaped: nothing of it runs when this returns."""
        assert self.daemon is not None
        self.daemon.proc.kill()
        self.daemon.proc.wait(30)

    def daemon_stats(self) -> dict | None:
        """The daemon's ``stats`` (None when it does not answer in 10 s)."""
        from kvstore import Client

        try:
            with Client(str(self.config.socket_path), timeout_s=10.0) as client:
                return client.stats()
        except Exception:  # a stopped or dead daemon: the caller records the absence
            return None

    # -- the engine ----------------------------------------------------------------------------
    def _engine_cmd(self, offload: bool, num_kv_blocks: int,
                    prefix_cache: bool = False) -> list[str]:
        c = self.config
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(c.model_dir),
               "--device", c.device, "--port", "0", "--num-kv-blocks", str(num_kv_blocks),
               "--max-model-len", str(c.max_model_len), "--block-size", str(c.block_size),
               "--max-num-seqs", str(c.max_num_seqs), "--seed", "0", "--served-model-name",
               MODEL_NAME, *c.engine_args]
        if offload:
            cmd += ["--kv-offload", "--kv-store-socket", str(c.socket_path)]
        elif not prefix_cache:
            cmd += ["--no-enable-prefix-caching"]
        return cmd

    def start_engine(self) -> tuple[float, float]:
        """Start the engine under test and warm it up: (seconds to listening, to warm)."""
        started = time.monotonic()
        self.engine = ServerProcess(self._engine_cmd(True, self.config.num_kv_blocks),
                                    "kvengine serve --kv-offload")
        url = self.engine.wait_for(r"listening on (http://\S+)", self.config.start_timeout_s)
        listening_s = time.monotonic() - started
        self._warm_up(url.group(1))
        self.url = url.group(1)
        self.engine_incarnation += 1
        return listening_s, time.monotonic() - started

    def stop_engine(self, sig: int) -> int:
        """Send ``sig`` to the engine and reap it (SIGKILL after 60 s); its exit status."""
        assert self.engine is not None
        self.engine.stop(sig, timeout_s=60.0)
        return self.engine.proc.returncode

    def engine_health(self, timeout_s: float = 5.0) -> dict | None:
        """The engine's /health body (``kv_store``: ok, hung or down); None without an answer."""
        try:
            return httpx.get(self.url + "/health", timeout=timeout_s).json()
        except (httpx.HTTPError, ValueError):
            return None

    def _engine_series(self, family: str, label: str) -> dict[str, float]:
        """One labelled family of the engine's /metrics, by ``label``'s value ({} without an
        answer)."""
        try:
            text = httpx.get(self.url + "/metrics", timeout=10.0).text
        except httpx.HTTPError:
            return {}
        series = {}
        for line in text.splitlines():
            if line.startswith(family + "{"):
                labels, value = line.rsplit(" ", 1)
                series[labels.split(f'{label}="', 1)[1].split('"', 1)[0]] = float(value)
        return series

    def engine_offload_events(self) -> dict[str, float]:
        """The engine's --kv-offload event counts from its /metrics ({} without an answer)."""
        return self._engine_series(_EVENTS, "event")

    def engine_allocator_bytes(self) -> dict[str, int]:
        """The engine's device allocator, ``held`` and ``in_use`` bytes ({} on host backends
        or without an answer)."""
        return {k: int(v) for k, v in self._engine_series(_ALLOCATOR, "state").items()}

    def pids(self) -> dict[str, int]:
        """The live processes under test by role."""
        out = {}
        for role, proc in (("daemon", self.daemon), ("engine", self.engine)):
            if proc is not None and proc.proc.poll() is None:
                out[role] = proc.proc.pid
        return out

    def reference_engine(self, num_kv_blocks: int,
                         prefix_cache: bool = False) -> tuple[ServerProcess, str]:
        """Start a reference engine (no offload; a prefix cache only for the scorer):
        (process, URL)."""
        role = "scorer" if prefix_cache else "reference"
        proc = ServerProcess(self._engine_cmd(False, num_kv_blocks, prefix_cache),
                             f"kvengine serve ({role})")
        url = proc.wait_for(r"listening on (http://\S+)", self.config.start_timeout_s).group(1)
        return proc, url

    def close(self) -> None:
        """Stop whatever still runs (a stopped daemon is continued first, so it can exit)."""
        if self.engine is not None:
            self.engine.stop(signal.SIGTERM, timeout_s=30.0)
        if self.daemon is not None:
            if self.daemon.proc.poll() is None:
                os.kill(self.daemon.proc.pid, signal.SIGCONT)
            self.daemon.stop(signal.SIGTERM, timeout_s=30.0)
