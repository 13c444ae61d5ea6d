"""Cluster test parts: a real redis-server per test, nodes with real TieredStores, block data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_parts import FAST, RedisServer

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
