"""Cluster test parts: a real redis-server per test, nodes with real TieredStores, block data,
`kvstore serve --cluster` daemons."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cluster_parts import FAST, RedisServer, daemon_stats, free_port
from daemon_helpers import RunningDaemon, start_daemon, wait_until

from kvstore.cluster.config import ClusterConfig


@pytest.fixture(scope="session")
def ucx_runtime():
    """Hold the process's UCX runtime for the whole session: nodes then start and stop without
    re-initialising UCX each time (about a second per test)."""
    from kvstore.cluster.ucx.runtime import UcxRuntime

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
    from kvstore.cluster.node import ClusterNode
    from kvstore.store.tiered import StoreConfig, TieredStore

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


@pytest.fixture
def start_nodes(redis_server, tmp_path):
    """``start_nodes("a", "b", http=..., flags=(...))``: `kvstore serve --cluster` daemons
    (``flags`` added to each command line), started together, all stopped (together) at
    teardown."""
    started: list[RunningDaemon] = []

    def start_one(node_id: str, http: bool, flags: tuple[str, ...]) -> RunningDaemon:
        return start_daemon(tmp_path, "--cluster", redis_server.url, "--node-id", node_id,
                            "--listen", f"127.0.0.1:{free_port()}", *flags, dram="64MiB",
                            http=http)

    def start(*node_ids: str, http: bool = False,
              flags: tuple[str, ...] = ()) -> list[RunningDaemon]:
        with ThreadPoolExecutor(len(node_ids)) as pool:
            daemons = list(pool.map(lambda n: start_one(n, http, flags), node_ids))
        started.extend(daemons)
        for daemon in daemons:  # each sees the others before the test asks anything
            assert wait_until(lambda d=daemon: daemon_stats(d)["cluster"]["index"]["live_nodes"]
                              >= len(node_ids), 5.0)
        return daemons

    yield start
    for daemon in started:
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGTERM)
    for daemon in started:
        daemon.stop()
