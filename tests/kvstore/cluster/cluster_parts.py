"""Block data, fast timings, a real redis-server and small helpers shared by the cluster tests
(and the reliability tests that fault them) and their node process."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from daemon_helpers import wait_until

from kvstore.keys import Namespace, block_hashes, block_ident

# Short timings so failure paths finish in well under a second each.
FAST = {"heartbeat_interval_s": 0.1, "node_ttl_s": 0.5, "redis_timeout_s": 0.2,
        "remote_timeout_s": 1.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.2,
        "flush_interval_s": 0.002}


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for automatic (bind to 0, outgoing) ports."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now on every interface and below the kernel's ephemeral range, so no
    automatic bind (another daemon's UCX sockets, a client's) takes it before its user binds
    it: a port from bind(0) is ephemeral, and once released it was seen taken that way (a
    cluster fixture's second daemon failed with "Address already in use")."""
    low, high = _ephemeral_ports()
    first, last = (10000, low - 1) if low > 11000 else (high + 1, 65535)
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(first, last)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}..{last}")


@dataclass
class Blocks:
    """A chain of KV-like blocks: hashes, idents and random payloads."""

    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]
    payloads: list[bytes]

    def put_all(self, store, node=None, count: int | None = None) -> None:
        """Store the first ``count`` blocks; with ``node``, publish them and wait for Redis."""
        n = len(self.hashes) if count is None else count
        for h, ident, data in zip(self.hashes[:n], self.idents[:n], self.payloads[:n]):
            store.put(self.namespace, h, ident, data)
        if node is not None:
            node.on_stored(self.namespace, self.hashes[:n])
            assert node.index.flush(2.0)


def shm_lanes() -> set[str]:
    """The shared-memory lanes UCX adds between endpoints of one host: none unless
    UCX_MM_ERROR_HANDLING is on (UCX leaves out transports without peer-failure handling, which
    ucxx's endpoints ask for, and its shared memory has that only when told)."""
    on = os.environ.get("UCX_MM_ERROR_HANDLING", "n").lower() in ("y", "yes", "on", "1")
    return {"posix/memory", "sysv/memory"} if on else set()


def daemon_stats(daemon) -> dict:
    """A running daemon's ``stats`` (a ``daemon_helpers.RunningDaemon``)."""
    with daemon.client(timeout_s=5.0) as c:
        return c.stats()


def index_caught_up(daemon, num_blocks: int) -> bool:
    """Everything the daemon stored has reached Redis (at least ``num_blocks`` published)."""
    index = daemon_stats(daemon)["cluster"]["index"]
    return index["state"] == "up" and index["pending_events"] == 0 and \
        index["published_blocks"] >= num_blocks


def make_blocks(num_blocks: int, block_bytes: int = 64 << 10, seed: int = 0) -> Blocks:
    rng = np.random.default_rng(seed)
    ns = Namespace(tenant_salt="t", name=f"test-{seed}").digest
    tokens = rng.integers(0, 50_000, size=num_blocks * 16)
    hashes = block_hashes(ns, tokens, 16)
    parents = [ns, *hashes[:-1]]
    idents = [block_ident(parents[i], tokens[i * 16:(i + 1) * 16]) for i in range(num_blocks)]
    payloads = [rng.bytes(block_bytes) for _ in range(num_blocks)]
    return Blocks(ns, hashes, idents, payloads)


class RedisServer:
    """A real redis-server on a free port in a temp dir, without persistence."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until(self._answers, 5.0):
            self.stop()
            raise RuntimeError("redis-server did not start")

    def _answers(self) -> bool:
        try:
            return self.client().ping()
        except Exception:
            return False

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(5)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def command_calls(self) -> dict[str, int]:
        stats = self.client().info("commandstats")
        return {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}
