"""Cross-node sharing with real parts: redis-server, TieredStores, UCX between ClusterNodes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_parts import make_blocks, wait_until

pytestmark = pytest.mark.cluster


def test_put_on_a_fetch_same_bytes_on_b_then_c(make_node):
    a, store_a = make_node("a")
    b, store_b = make_node("b")
    c, store_c = make_node("c")
    blocks = make_blocks(40, block_bytes=96 << 10)
    blocks.put_all(store_a, a, count=30)
    ns, hashes, idents = blocks.namespace, blocks.hashes, blocks.idents

    assert store_b.lookup(ns, hashes, idents, lease_ttl_s=None).num_hit == 0
    assert b.fetch_remote_prefix(ns, hashes, idents, start_index=0) == 30
    for i in range(30):
        assert store_b.get(ns, hashes[i], idents[i]) == blocks.payloads[i]
    # Now served locally (DRAM) like any other block; the rest is a miss everywhere.
    assert store_b.lookup(ns, hashes, idents, lease_ttl_s=None).num_hit == 30
    assert b.fetch_remote_prefix(ns, hashes, idents, start_index=30) == 0
    stats = b.stats()
    assert stats["remote_hit_blocks"] == 30 and stats["remote_hits"] == 1
    assert stats["remote_misses"] == 1
    assert a.stats()["server"]["blocks_sent"] == 30

    # b re-published what it fetched: c can fetch a prefix that starts further in, from a or b.
    assert b.index.flush(2.0)
    assert c.fetch_remote_prefix(ns, hashes, idents, start_index=10) == 20
    assert store_c.lookup(ns, hashes, idents, lease_ttl_s=None).num_hit == 0  # 0..9 not fetched
    for i in range(10, 30):
        assert store_c.get(ns, hashes[i], idents[i]) == blocks.payloads[i]


def test_wrong_idents_fetch_nothing(make_node):
    a, store_a = make_node("a")
    b, store_b = make_node("b")
    blocks = make_blocks(4)
    blocks.put_all(store_a, a)
    forged = [blocks.idents[0], b"someone else's tokens", *blocks.idents[2:]]
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, forged) == 1  # verified at a
    assert store_b.lookup(blocks.namespace, blocks.hashes, blocks.idents,
                          lease_ttl_s=None).num_hit == 1


def test_index_writes_are_batched(make_node, redis_server):
    # A registration that lapses re-publishes everything held (correct, but it would double the
    # count below): on a loaded 2-core machine the 0.5 s TTL of the fast settings can lapse.
    # Batches close at 500 writes, not by time, and heartbeats (each flushes what is pending)
    # come every 3 s: with a 50 ms flush interval and the fast 0.1 s heartbeat, CI's load made
    # 38-57 calls of the loop below. Now at most two calls a batch (its rest included), one a
    # heartbeat and the last flush, unless the loop takes tens of seconds.
    a, store_a = make_node("a", flush_interval_s=30.0, flush_max_batch=500,
                           heartbeat_interval_s=3.0, node_ttl_s=10.0)
    b, _ = make_node("b")
    blocks = make_blocks(2000, block_bytes=4096)
    redis_server.client().config_resetstat()
    for start in range(0, 2000, 16):  # the way a daemon saves: a few blocks per call
        end = start + 16
        for i in range(start, end):
            store_a.put(blocks.namespace, blocks.hashes[i], blocks.idents[i], blocks.payloads[i])
        a.on_stored(blocks.namespace, blocks.hashes[start:end])
    assert a.index.flush(5.0)
    calls = redis_server.command_calls()
    index_stats = a.stats()["index"]
    # Every block reached Redis, in a handful of script calls (round trips), not 2000.
    assert a.index.stats().get("resyncs", 0) == 0
    assert calls.get("hset", 0) == 2000
    assert calls.get("evalsha", 0) + calls.get("eval", 0) <= 20
    assert index_stats["flushed_events"] == 2000 and index_stats["flush_batches"] <= 20

    redis_server.client().config_resetstat()
    found = b.index.lookup_prefix(blocks.namespace, blocks.hashes[:1024])
    assert found == [("a", a.addr)] * 1024
    calls = redis_server.command_calls()
    assert calls.get("evalsha", 0) == 1 and calls.get("hmget", 0) == 1  # one round trip


def _sees(node, node_id: str, incarnation: str) -> bool:
    peer = node.index.live_nodes().get(node_id)
    return peer is not None and peer.incarnation == incarnation


def test_older_incarnation_entries_are_ignored(make_node, redis_server):
    a, store_a = make_node("a")
    b, store_b = make_node("b")
    blocks = make_blocks(8)
    blocks.put_all(store_a, a, count=2)
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 2
    blocks.put_all(store_a, a)
    port, old_incarnation = a.server.port, a.incarnation
    a.stop()
    store_a.close()

    # a comes back empty, on the same address, under a new incarnation; its old entries still
    # sit in Redis, and b still caches an endpoint to the old process.
    a2, store_a2 = make_node("a", listen_port=port)
    assert a2.addr == a.addr and a2.incarnation != old_incarnation
    assert wait_until(lambda: _sees(b, "a", a2.incarnation), 2.0)
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents, 2) == 0
    assert b.stats()["remote_misses"] == 1
    assert a2.stats()["server"].get("requests", 0) == 0  # no fetch was even tried
    # The stale entries that the lookup met were queued for deletion.
    assert b.index.flush(2.0)
    assert redis_server.client().hget(b"kvstore:h:" + blocks.namespace, blocks.hashes[2]) is None

    blocks.put_all(store_a2, a2, count=5)
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents, 2) == 3
    assert store_b.get(blocks.namespace, blocks.hashes[4], blocks.idents[4]) == blocks.payloads[4]
    client_stats = b.stats()["client"]
    assert client_stats["stale_endpoints"] == 1 and client_stats["connections_opened"] == 2


def test_stopped_node_is_a_prompt_miss(make_node):
    a, store_a = make_node("a")
    b, _ = make_node("b")
    blocks = make_blocks(6)
    blocks.put_all(store_a, a)
    a.stop()  # a clean stop deregisters at once
    assert wait_until(lambda: "a" not in b.index.live_nodes(), 1.0)
    start = time.monotonic()
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 0
    assert time.monotonic() - start < 0.5  # the deadline is 1 s
    assert b.stats()["remote_misses"] == 1


def _spawn_node(redis_url: str, node_id: str, num_blocks: int, seed: int):
    script = Path(__file__).with_name("node_process.py")
    proc = subprocess.Popen([sys.executable, str(script), redis_url, node_id, str(num_blocks),
                             str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError("node process died before it was ready")
    return proc, json.loads(line)


def test_killed_node_in_another_process(make_node, redis_server):
    b, store_b = make_node("b")
    blocks = make_blocks(12, seed=7)
    proc, info = _spawn_node(redis_server.url, "a", 12, seed=7)
    try:
        assert wait_until(lambda: "a" in b.index.live_nodes(), 2.0)
        ns, hashes, idents = blocks.namespace, blocks.hashes, blocks.idents
        assert b.fetch_remote_prefix(ns, hashes, idents, start_index=4) == 8
        assert store_b.get(ns, hashes[11], idents[11]) == blocks.payloads[11]

        proc.kill()  # no deregistration: Redis still lists a until its heartbeat key expires
        proc.wait(5)
        start = time.monotonic()
        assert b.fetch_remote_prefix(ns, hashes, idents, start_index=0) == 0
        assert time.monotonic() - start <= b.config.remote_timeout_s + 0.5
        errors = {k: v for k, v in b.stats().items() if k.startswith("remote_errors_")}
        assert sum(errors.values()) == 1, errors  # refused or reset: counted, not raised

        # Once a's key expired, the index no longer offers it: a miss without any fetch.
        assert wait_until(lambda: "a" not in b.index.live_nodes(), 2.0)
        opened = b.stats()["client"].get("connections_opened", 0)
        assert b.fetch_remote_prefix(ns, hashes, idents, start_index=0) == 0
        assert b.stats()["client"].get("connections_opened", 0) == opened
        assert b.stats()["remote_misses"] >= 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def test_peer_client_fetch_returns_the_bytes(make_node):
    a, store_a = make_node("a")
    b, _ = make_node("b")
    blocks = make_blocks(5, block_bytes=50_000)
    blocks.put_all(store_a, a, count=3)
    deadline = time.monotonic() + 2.0
    with b.client.fetch(a.addr, blocks.namespace, blocks.hashes, blocks.idents,
                        deadline) as result:
        assert result.error is None
        assert [bytes(v) for v in result.blocks] == blocks.payloads[:3]
    assert result.blocks == []  # released: the buffer goes back to the pool
    again = b.client.fetch(a.addr, blocks.namespace, blocks.hashes[3:], blocks.idents[3:],
                           time.monotonic() + 2.0)
    assert again.blocks == [] and again.error is None  # a holds none of them: a short answer


def test_full_local_store_ends_the_run_without_error(make_node):
    a, store_a = make_node("a")
    b, store_b = make_node("b", dram_bytes=4 << 20)
    blocks = make_blocks(12, block_bytes=1 << 20)
    blocks.put_all(store_a, a)
    # b leases what it fetches, so nothing can be evicted to make room: the run stops there.
    num = b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents)
    assert 0 < num < 12
    leased = store_b.lookup(blocks.namespace, blocks.hashes, blocks.idents, lease_ttl_s=30.0)
    assert leased.num_hit == num
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents, num) == 0
    stats = b.stats()
    assert stats["remote_store_refused"] >= 1
    assert not [k for k in stats if k.startswith("remote_errors")]
    leased.lease.release()
    store_b.check_integrity()
