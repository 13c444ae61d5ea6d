"""Two real `kvstore serve --cluster` daemons over a real redis-server: what one stores, the other
serves (bytes API and block verbs, tier "remote"); a killed peer or a lost Redis costs a counted
miss, never a hang; engines on different daemons share a prompt's KV."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from cluster_parts import daemon_stats, index_caught_up
from daemon_helpers import RunningDaemon, make_chain, random_bytes, wait_until
from support.arena import ShmArena

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

BLOCK = 64 << 10


def _cluster(daemon: RunningDaemon) -> dict:
    return daemon_stats(daemon)["cluster"]


def _remote_errors(cluster: dict) -> int:
    return sum(v for k, v in cluster.items() if k.startswith("remote_errors_"))


def _arena(num_blocks: int, seed: int | None) -> ShmArena:
    """An engine's KV arena in POSIX shared memory, one contiguous region of blocks."""
    return ShmArena(num_blocks, BLOCK, seed)


def test_put_on_a_get_on_b_and_blocks_come_back_as_remote(start_nodes):
    a, b = start_nodes("a", "b", http=True)
    values = {b"small": b"x", b"page": random_bytes(4096, 1), b"big": random_bytes(3 << 20, 2)}
    with a.client() as ca:
        for key, value in values.items():
            ca.put(key, value)
    assert wait_until(lambda: index_caught_up(a, len(values)), 5.0)
    with b.client() as cb:
        for key, value in values.items():
            reply = cb.call("get", {"namespace": "default", "key": key})
            assert reply["value"] == value and reply["tier"] == "remote"
        assert cb.call("get", {"namespace": "default", "key": b"big"})["tier"] == "dram"
        assert cb.get(b"nobody-put-this") is None
    sent = _cluster(a)["server"]["blocks_sent"]
    assert sent == len(values)  # the second get was local

    # Block verbs: b holds the first 3 blocks of a chain, a all 8. One lookup on b hits all 8,
    # the last 5 as "remote", and a load through its lease gives a's exact bytes.
    src, dst = _arena(8, seed=3), _arena(8, seed=None)
    chain = make_chain("cluster-blocks", 8, seed=4)
    try:
        with a.client() as ca, b.client() as cb:
            reg_a = ca.register(src.layout, "engine-a")
            assert ca.save(reg_a, chain.namespace, list(range(8)), chain.hashes,
                           chain.idents).num_saved == 8
            reg_b = cb.register(src.layout, "engine-b")  # the same bytes, saved on b too
            assert cb.save(reg_b, chain.namespace, [0, 1, 2], chain.hashes[:3],
                           chain.idents[:3]).num_saved == 3
            assert wait_until(lambda: index_caught_up(a, len(values) + 8), 5.0)
            reply = cb.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=30.0)
            assert reply.num_hit == 8
            assert reply.tiers == ["dram"] * 3 + ["remote"] * 5
            reg_dst = cb.register(dst.layout, "engine-c")
            assert cb.load(reg_dst, reply.lease_id, list(range(8))) == 8
            assert [dst.block(i) for i in range(8)] == [src.block(i) for i in range(8)]
            again = cb.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=0)
            assert again.tiers == ["dram"] * 8  # stored on b now

            # A block a drops is withdrawn from the index: b can no longer find it there.
            # a's peer server pins what it sends until the send completes on its side, which
            # may be a moment after b has the bytes: a pinned block is not removed (0) yet.
            assert wait_until(lambda: ca.remove(chain.namespace, chain.hashes[7:]) == 1, 5.0)
            assert cb.remove(chain.namespace, chain.hashes[7:]) == 1
            assert wait_until(lambda: index_caught_up(a, 0) and index_caught_up(b, 0), 5.0)
            skipped = cb.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=0)
            assert skipped.num_hit == 7
    finally:
        src.close()
        dst.close()

    stats = daemon_stats(b)
    assert stats["tiers"]["remote"]["hits"] == len(values) + 5
    assert stats["cluster"]["remote_hit_blocks"] == len(values) + 5
    assert _remote_errors(stats["cluster"]) == 0
    metrics = httpx.get(b.http_url + "/metrics", timeout=5.0).text
    assert f"kvstore_cluster_remote_hit_blocks_total {float(len(values) + 5)}" in metrics
    assert "kvstore_cluster_index_up 1.0" in metrics
    assert 'kvstore_tier_hits_total{tier="remote"}' in metrics
    assert httpx.get(b.http_url + "/stats", timeout=5.0).json()["cluster"]["node_id"] == "b"


def test_killed_peer_is_a_prompt_counted_miss(start_nodes):
    a, b = start_nodes("a", "b")
    with a.client() as ca:
        ca.put(b"first", b"1" * 1000)
        ca.put(b"second", b"2" * 1000)
    assert wait_until(lambda: index_caught_up(a, 2), 5.0)
    with b.client() as cb:
        assert cb.get(b"first") == b"1" * 1000  # b now holds an endpoint to a
        a.kill9()  # no deregistration: Redis lists a until its heartbeat key expires
        start = time.monotonic()
        assert cb.get(b"second") is None
        elapsed = time.monotonic() - start
        assert elapsed < 2.0 + 0.5, elapsed  # remote_timeout_s is 2 s; a dead peer is faster
        assert cb.get(b"first") == b"1" * 1000  # fetched before: served locally
    cluster = _cluster(b)
    assert _remote_errors(cluster) == 1 and cluster["remote_errors"] == 1
    assert daemon_stats(b)["tiers"]["remote"]["misses"] >= 1


def test_lost_redis_keeps_both_serving_and_sharing_resumes(start_nodes, redis_server):
    a, b = start_nodes("a", "b")
    with a.client() as ca:
        ca.put(b"before", b"b" * 5000)
    assert wait_until(lambda: index_caught_up(a, 1), 5.0)

    redis_server.stop()
    with a.client() as ca, b.client() as cb:
        start = time.monotonic()
        ca.put(b"during", b"d" * 5000)  # stored here, advertised once Redis is back
        assert ca.get(b"during") == b"d" * 5000
        cb.put(b"local", b"l" * 10)
        assert cb.get(b"local") == b"l" * 10
        assert cb.get(b"before") is None  # the index is gone: a miss, not an error
        assert time.monotonic() - start < 3.0
        assert wait_until(lambda: _cluster(b)["index"]["state"] == "down", 5.0)

    redis_server.start()  # empty: both nodes register again and re-publish what they hold
    # (live_nodes is the view as of the last heartbeat that got through: b must be up again.)
    assert wait_until(lambda: index_caught_up(a, 2) and index_caught_up(b, 1)
                      and _cluster(b)["index"]["live_nodes"] == 2, 15.0)
    with b.client() as cb:
        assert cb.get(b"before") == b"b" * 5000
        assert cb.get(b"during") == b"d" * 5000
    assert _cluster(a)["index"]["resyncs"] >= 1


def test_engine_on_b_restores_a_prompt_computed_on_a(start_nodes, tmp_path):
    from engine import LLM, SamplingParams
    from engine.make_model import write_checkpoint

    model_dir = tmp_path / "tiny"
    write_checkpoint(model_dir, "tiny", seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = np.random.default_rng(5).integers(10, 1000, 16 * 12 + 5).tolist()
    a, b = start_nodes("a", "b")

    def run(**kwargs):
        llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, **kwargs)
        try:
            out = llm.generate([prompt], greedy)[0]
            if kwargs.get("kv_offload"):
                llm.engine.offload.wait_idle()  # write-through saves are in the store
            return out
        finally:
            llm.close()

    reference = run(enable_prefix_caching=False).token_ids
    first = run(kv_offload=True, kv_store_socket=str(a.socket_path))
    assert first.token_ids == reference and first.num_cached_tokens == 0
    assert wait_until(lambda: index_caught_up(a, 12), 5.0)
    # Tiny blocks recompute faster than they cross a socket: restore regardless.
    second = run(kv_offload=True, kv_store_socket=str(b.socket_path),
                 kv_offload_restore="always")
    assert second.token_ids == reference
    assert second.cached_tokens_by_tier["remote"] == 12 * 16
    assert second.cached_tokens_by_tier["dram"] == 0
    assert daemon_stats(b)["tiers"]["remote"]["hits"] == 12


def test_cluster_flags_are_checked_and_nothing_is_imported_without_them(tmp_path):
    for flags, message in (
            (["--cluster", "http://127.0.0.1:6379"], "--cluster must be redis://"),
            (["--node-id", "a"], "--node-id need(s) --cluster"),
            (["--cluster", "redis://127.0.0.1:6379/0", "--listen", "0.0.0.0:7000"],
             "needs --advertise")):
        proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--http", "off",
                               "--socket", str(tmp_path / "s.sock"), *flags],
                              capture_output=True, text=True, timeout=30,
                              cwd=Path(__file__).resolve().parents[3])
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    code = ("import sys, kvstore.cli.command, kvstore.daemon.server, kvstore.daemon.service, "
            "kvstore.daemon.admin; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'ucxx') "
            "or m.startswith(('kvstore.cluster.node', 'kvstore.cluster.peers'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=True, cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "[]"


def test_a_cluster_daemon_starts_without_ucx_warnings(start_nodes):
    # ucxx sets UCX_MEMTYPE_CACHE, which UCX no longer reads: its warning must not reach users.
    (daemon,) = start_nodes("quiet")
    assert not [line for line in daemon.lines if "UCX" in line and "WARN" in line], daemon.lines
