"""vLLM across a kvstore cluster: what a vLLM instance on one node computes, a vLLM instance on
another node gets as an external prefix hit, fetched from the first node's daemon over UCX.

Real parts only: a ``redis-server``, two ``kvstore serve --cluster`` daemons (UCX over TCP
loopback), and three vLLM processes on CPU: ``a`` on daemon a, ``b`` on daemon b, and a
``baseline`` without the connector for the reference logprobs.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_helpers import RunningDaemon, start_daemon, wait_until
from vllm_parts import BLOCK_SIZE, assert_same_logprobs, full_blocks_tokens, prompt

from benchmarks.vllm_process import VllmProcess, vllm_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvstore" / "cluster"))
from cluster_parts import RedisServer, free_port  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cluster,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]


def _stats(daemon: RunningDaemon) -> dict:
    with daemon.client(timeout_s=5.0) as c:
        return c.stats()


def _published(daemon: RunningDaemon, num_blocks: int) -> bool:
    """Everything ``daemon`` stored has reached Redis (``num_blocks`` at least)."""
    index = _stats(daemon)["cluster"]["index"]
    return index["state"] == "up" and index["pending_events"] == 0 and \
        index["published_blocks"] >= num_blocks


@pytest.fixture
def cluster(tmp_path):
    """Daemons ``a`` and ``b`` on one redis-server, each seeing the other."""
    redis = RedisServer(tmp_path)
    redis.start()
    daemons: list[RunningDaemon] = []
    try:
        def start_one(node_id: str) -> RunningDaemon:
            return start_daemon(tmp_path, "--cluster", redis.url, "--node-id", node_id,
                                "--listen", f"127.0.0.1:{free_port()}", dram="256MiB",
                                http=False)

        with ThreadPoolExecutor(2) as pool:
            daemons.extend(pool.map(start_one, ("a", "b")))
        for d in daemons:
            assert wait_until(lambda d=d: _stats(d)["cluster"]["index"]["live_nodes"] >= 2, 10.0)
        yield dict(zip(("a", "b"), daemons))
    finally:
        for d in daemons:
            d.stop()
        redis.stop()


def test_a_prompt_computed_on_one_node_is_an_external_hit_on_another(cluster,
                                                                     small_model_dir) -> None:
    a, b = cluster["a"], cluster["b"]
    procs = {"baseline": VllmProcess(small_model_dir, None, wait=False),
             "a": VllmProcess(small_model_dir, a.socket_path, wait=False),
             "b": VllmProcess(small_model_dir, b.socket_path, wait=False)}
    try:
        for p in procs.values():
            p.wait_ready()
        p = prompt(31)
        num_blocks = len(p) // BLOCK_SIZE
        want = procs["baseline"].ask(p)
        on_a = procs["a"].ask(p)
        assert on_a["num_cached_tokens"] == 0
        assert_same_logprobs(on_a, want)
        assert wait_until(lambda: _published(a, num_blocks), 10.0)
        assert _stats(b)["tiers"]["dram"]["blocks"] == 0  # b holds nothing of it itself

        before = procs["b"].ask(prompt(32, 64))  # b's counters before the hit
        on_b = procs["b"].ask(p)
        hit = full_blocks_tokens(len(p))
        assert on_b["num_cached_tokens"] == hit
        assert on_b["external_hits"] - before["external_hits"] == hit
        # The connector reports the blocks' tier: fetched from a peer, vLLM's "p2p" source.
        p2p = on_b["cached_by_source"].get("p2p", 0) - before["cached_by_source"].get("p2p", 0)
        assert p2p == hit
        assert_same_logprobs(on_b, want)

        stats_b = _stats(b)
        assert stats_b["tiers"]["remote"]["hits"] >= hit // BLOCK_SIZE
        assert stats_b["tiers"]["dram"]["blocks"] >= hit // BLOCK_SIZE  # fetched, kept on b
        assert _stats(a)["cluster"]["server"]["blocks_sent"] >= hit // BLOCK_SIZE
    finally:
        for proc in procs.values():
            proc.stop()
