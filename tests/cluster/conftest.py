"""Cluster test parts: a real redis-server per test, nodes with real TieredStores, block data."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_parts import FAST, free_port, wait_until

from kvstore.cluster_config import ClusterConfig


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


@pytest.fixture(scope="session")
def ucx_runtime():
    """Hold the process's UCX runtime for the whole session: nodes then start and stop without
    re-initialising UCX each time (about a second per test)."""
    from kvstore.ucx_runtime import UcxRuntime

    runtime = UcxRuntime.acquire()
    yield runtime
    runtime.release()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_node(redis_server: RedisServer, ucx_runtime):
    """``make_node(node_id, **config)`` → (ClusterNode, TieredStore), all stopped at teardown."""
    from kvstore.cluster_node import ClusterNode
    from kvstore.tiered_store import StoreConfig, TieredStore

    made: list[tuple[ClusterNode, TieredStore]] = []

    def make(node_id: str, dram_bytes: int = 64 << 20, **options):
        config = ClusterConfig(redis_url=redis_server.url, node_id=node_id,
                               **{**FAST, **options})
        store = TieredStore(StoreConfig(dram_bytes=dram_bytes))
        node = ClusterNode(config, store)
        made.append((node, store))
        node.start()
        return node, store

    yield make
    for node, store in reversed(made):
        node.stop()
        store.close()
