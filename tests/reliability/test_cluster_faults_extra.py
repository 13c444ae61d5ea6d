"""Cluster faults on real `kvstore serve --cluster` daemons over UCX and a real redis-server, the
cases tests/kvstore/cluster does not cover: a peer killed or paused (SIGSTOP) in the middle of
sending a lookup's blocks, a peer that sends wrong bytes (its SSD copy damaged; a daemon variant
whose peer server announces wrong checksums), Redis paused and flushed (FLUSHALL) under running
daemons.

Each ends the same way: the fetching daemon answers by its deadline with a miss (or a verified
prefix), never wrong bytes; no write slot or DRAM stays reserved; its local service goes on
meanwhile; and sharing works again once the fault is gone. (Redis stopped and restarted under
running daemons is tests/kvstore/cluster/test_cluster_daemons.py; lying, silent, stalling and
unreachable in-process peers are tests/kvstore/cluster/test_cluster_faults.py.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import RunningDaemon, make_chain, random_bytes, start_daemon, wait_until
from support.arena import ShmArena

from kvstore.cluster.peers.transport import checksum

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvstore" / "cluster"))
from cluster_parts import RedisServer, free_port  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

REMOTE_TIMEOUT_S = 2.0  # ClusterConfig's default deadline of one remote fetch
SUSPECT_S = 5.0  # a peer that failed is skipped this long (node_ttl_s by default)
SLACK_S = 1.0

# A `kvstore serve` whose peer server lies: it announces a wrong checksum for the payloads named
# in $KVSTORE_TEST_LIE_ABOUT (their true XXH3-64 values), as a flipped bit on the wire would.
LYING_SITECUSTOMIZE = '''
import os
from kvstore.cluster.peers import server as peer_server
from kvstore.cluster.peers import transport as peer_transport

_BAD = {int(v) for v in os.environ["KVSTORE_TEST_LIE_ABOUT"].split(",")}


def _lying_checksum(data):
    value = peer_transport.checksum(data)
    return value ^ 1 if value in _BAD else value


peer_server.checksum = _lying_checksum
'''


@pytest.fixture
def redis_server(tmp_path: Path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def start_node(redis_server: RedisServer, tmp_path: Path):
    """``start_node(node_id, dram=..., env=..., ...)``: a cluster daemon; all stopped after."""
    started: list[RunningDaemon] = []

    def start(node_id: str, dram: str = "128MiB", **kwargs) -> RunningDaemon:
        daemon = start_daemon(tmp_path, "--cluster", redis_server.url, "--node-id", node_id,
                              "--listen", f"127.0.0.1:{free_port()}", dram=dram, http=False,
                              **kwargs)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:  # all stop together: each takes a moment to leave the cluster
        if daemon.proc.poll() is None:
            os.kill(daemon.proc.pid, signal.SIGCONT)
            daemon.proc.send_signal(signal.SIGTERM)
    for daemon in started:
        daemon.stop()


def _start_pair(start_node, a: str = "a", b: str = "b", a_kwargs: dict | None = None,
                b_kwargs: dict | None = None) -> tuple[RunningDaemon, RunningDaemon]:
    """Two cluster daemons, started side by side; returned once each sees the other."""
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(start_node, a, **(a_kwargs or {}))
        second = pool.submit(start_node, b, **(b_kwargs or {}))
        pair = first.result(), second.result()
    assert wait_until(lambda: _sees(pair[0], 2) and _sees(pair[1], 2), 10.0)
    return pair


def _stats(daemon: RunningDaemon) -> dict:
    with daemon.client(timeout_s=5.0) as c:
        return c.stats()


def _sees(daemon: RunningDaemon, num_nodes: int) -> bool:
    index = _stats(daemon)["cluster"]["index"]
    return index["state"] == "up" and index["live_nodes"] >= num_nodes


def _published(daemon: RunningDaemon, num_blocks: int) -> bool:
    index = _stats(daemon)["cluster"]["index"]
    return (index["state"] == "up" and index["pending_events"] == 0
            and index["published_blocks"] >= num_blocks)


def _dram_at_rest(daemon: RunningDaemon, used_bytes: int) -> bool:
    dram = _stats(daemon)["tiers"]["dram"]
    return dram["in_flight_blocks"] == 0 and dram["used_bytes"] == used_bytes


def _remote_errors(daemon: RunningDaemon) -> dict:
    cluster = _stats(daemon)["cluster"]
    return {k: v for k, v in cluster.items() if k.startswith("remote_errors_") and v}


@pytest.fixture
def arena():
    made: list[ShmArena] = []

    def make(num_blocks: int, block_bytes: int, seed: int | None = None) -> ShmArena:
        made.append(ShmArena(num_blocks, block_bytes, seed))
        return made[-1]

    yield make
    for a in made:
        a.close()


class BackgroundLookup:
    """One lookup on ``daemon`` in a thread: it fetches what a peer holds."""

    def __init__(self, daemon: RunningDaemon, chain) -> None:
        self.reply = None
        self.elapsed_s = 0.0
        self._client = daemon.client(timeout_s=30.0)
        self._thread = threading.Thread(target=self._run, args=(chain,), daemon=True)
        self._thread.start()

    def _run(self, chain) -> None:
        start = time.monotonic()
        self.reply = self._client.lookup(chain.namespace, chain.hashes, chain.idents,
                                         lease_ttl_s=30.0)
        self.elapsed_s = time.monotonic() - start

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the lookup did not return by its deadline"
        self._client.close()


def _freeze_mid_transfer(a: RunningDaemon, b: RunningDaemon, chain) -> BackgroundLookup | None:
    """Start b's lookup of ``chain`` (which only a holds) and SIGSTOP a while b is receiving
    it: b has reserved write slots for the blocks and the lookup has not returned. None if the
    transfer finished first (a is then running again)."""
    lookup = BackgroundLookup(b, chain)
    with b.client(timeout_s=5.0) as watcher:
        while lookup.running:
            if watcher.stats()["tiers"]["dram"]["in_flight_blocks"] > 0:
                os.kill(a.proc.pid, signal.SIGSTOP)
                break
    time.sleep(0.2)  # whatever was already on its way lands
    if lookup.running:
        return lookup
    os.kill(a.proc.pid, signal.SIGCONT)
    lookup.join(5.0)
    return None


def _two_nodes_with_a_chain(start_node, arena, num_blocks: int, block_bytes: int, seed: int):
    a, b = _start_pair(start_node)
    src = arena(num_blocks, block_bytes, seed=seed)
    chain = make_chain(f"mid-transfer-{seed}", num_blocks, seed=seed)
    with a.client() as ca:
        reg = ca.register(src.layout, "engine-a")
        assert ca.save(reg, chain.namespace, range(num_blocks), chain.hashes,
                       chain.idents).num_saved == num_blocks
    assert wait_until(lambda: _published(a, num_blocks), 10.0)
    return a, b, src, chain


# 40 blocks of 2 MiB: about 0.1 s on the loopback, long enough to stop the sender in the middle.
NUM_BLOCKS, BLOCK_BYTES = 40, 2 << 20


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_peer_fault_mid_transfer_is_a_bounded_miss(start_node, arena, fault: str) -> None:
    for attempt in range(4):  # a transfer that outran the watcher is tried again, with new blocks
        a, b, src, chain = _two_nodes_with_a_chain(start_node, arena, NUM_BLOCKS, BLOCK_BYTES,
                                                   seed=attempt)
        lookup = _freeze_mid_transfer(a, b, chain)
        if lookup is not None:
            break
        a.stop()
        b.stop()
    else:
        pytest.fail("every transfer finished before the sender could be stopped")

    if fault == "kill":
        a.kill9()
    # Meanwhile b serves its own clients: the stuck fetch holds nobody else up.
    with b.client(timeout_s=5.0) as cb:
        start = time.monotonic()
        cb.put(b"local", b"L" * 10_000)
        assert cb.get(b"local") == b"L" * 10_000
        assert time.monotonic() - start < 0.5
    lookup.join(REMOTE_TIMEOUT_S + SLACK_S + 2.0)
    assert lookup.elapsed_s < REMOTE_TIMEOUT_S + SLACK_S, lookup.elapsed_s
    # A transfer that broke off stores nothing: no block is visible half-written.
    assert lookup.reply.num_hit == 0, lookup.reply
    assert set(_remote_errors(b)) <= {"remote_errors_timeout", "remote_errors_transport"}
    assert _remote_errors(b)
    # Every reserved slot is given back (the local value stays): nothing leaked. The slots of
    # a transfer broken off by its deadline go back as its cancellation completes, which on a
    # loaded host can be just after the reply (seen once in a full suite on the 2-core VM).
    assert wait_until(lambda: _stats(b)["tiers"]["dram"]["used_bytes"] < BLOCK_BYTES, 5.0)
    local_bytes = _stats(b)["tiers"]["dram"]["used_bytes"]
    assert wait_until(lambda: _dram_at_rest(b, local_bytes), 5.0)
    assert b.proc.poll() is None

    if fault == "kill":
        start = time.monotonic()  # the dead peer is suspect: no second wait on it
        with b.client() as cb:
            assert cb.lookup(chain.namespace, chain.hashes, chain.idents,
                             lease_ttl_s=0).num_hit == 0
        assert time.monotonic() - start < 0.5
        return

    # Recovery: a runs again; once it is no longer suspect, b fetches the whole chain intact.
    os.kill(a.proc.pid, signal.SIGCONT)
    dst = arena(NUM_BLOCKS, BLOCK_BYTES)
    with b.client() as cb:
        deadline = time.monotonic() + SUSPECT_S + 5.0
        while (reply := cb.lookup(chain.namespace, chain.hashes, chain.idents,
                                  lease_ttl_s=30.0)).num_hit < NUM_BLOCKS:
            assert time.monotonic() < deadline, reply
            if reply.lease_id is not None:
                cb.release(reply.lease_id)
            time.sleep(0.25)
        reg = cb.register(dst.layout, "engine-b")
        assert cb.load(reg, reply.lease_id, range(NUM_BLOCKS)) == NUM_BLOCKS
    assert np.array_equal(dst.blocks, src.blocks)


def test_peer_with_damaged_ssd_sends_no_wrong_bytes(start_node, tmp_path: Path) -> None:
    """a's values went to its SSD (8 MiB of DRAM for 24 MiB), whose files are then damaged:
    b gets each value exactly or not at all; a's checksums catch the damage before anything is
    sent, and a's undamaged blocks still reach b."""
    ssd = tmp_path / "ssd-a"
    a, b = _start_pair(start_node, a_kwargs={"dram": "8MiB", "ssd_dir": ssd,
                                             "ssd_size": "64MiB"})
    values = {b"v%d" % i: random_bytes(1 << 20, i) for i in range(24)}
    with a.client() as ca:
        for key, value in values.items():
            ca.put(key, value)
    # 24 MiB written through to a's SSD: seconds on a disk that other processes keep busy (a
    # fresh clone's suite once took past 10 s here); the bound is patience, not the property
    assert wait_until(lambda: _published(a, len(values)), 30.0)
    assert wait_until(lambda: _stats(a)["tiers"]["ssd"]["blocks"] == len(values), 30.0), \
        _stats(a)["tiers"]
    on_ssd_only = len(values) - _stats(a)["tiers"]["dram"]["blocks"]
    assert on_ssd_only >= 16

    damaged = 0
    for path in ssd.glob("data-*"):  # rot: every byte of every data file inverted
        with open(path, "r+b") as f:
            data = np.fromfile(f, np.uint8)
            f.seek(0)
            f.write((data ^ 0xFF).tobytes())
            os.fsync(f.fileno())
        damaged += data.size
    assert damaged > 0

    served = 0
    with b.client() as cb:
        for key, value in values.items():
            got = cb.get(key)
            assert got is None or got == value, f"{key!r}: other bytes"
            served += got is not None
    assert served <= len(values) - on_ssd_only
    assert _stats(a)["tiers"]["ssd"]["counters"]["corrupt"] >= on_ssd_only
    assert a.proc.poll() is None and b.proc.poll() is None
    # A block a holds intact still comes through; b's own service is untouched.
    fresh = random_bytes(1 << 20, 99)
    with a.client() as ca:
        ca.put(b"fresh", fresh)
    assert wait_until(lambda: _published(a, 1), 10.0)
    with b.client() as cb:
        assert cb.get(b"fresh") == fresh
        cb.put(b"mine", b"m" * 100)
        assert cb.get(b"mine") == b"m" * 100


def test_peer_announcing_wrong_checksums_is_a_verified_prefix(start_node, arena,
                                                              tmp_path: Path) -> None:
    """A daemon variant lies about block 3 of 6 on the wire: b keeps blocks 0-2 (exact bytes),
    counts a bad block, stores nothing else, and skips the liar afterwards."""
    block_bytes = 256 << 10
    src = arena(6, block_bytes, seed=7)
    hooks = tmp_path / "lying-peer"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(LYING_SITECUSTOMIZE)
    repo = Path(__file__).resolve().parents[2]
    liar, b = _start_pair(start_node, "liar", "b", a_kwargs={"env": {
        "PYTHONPATH": os.pathsep.join([str(hooks), str(repo), os.environ.get("PYTHONPATH", "")]),
        "KVSTORE_TEST_LIE_ABOUT": str(checksum(src.blocks[3]))}})
    chain = make_chain("lying-peer", 6, seed=8)
    with liar.client() as cl:
        reg = cl.register(src.layout, "engine-liar")
        assert cl.save(reg, chain.namespace, range(6), chain.hashes,
                       chain.idents).num_saved == 6
    assert wait_until(lambda: _published(liar, 6), 10.0)

    dst = arena(6, block_bytes)
    with b.client() as cb:
        reply = cb.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=30.0)
        assert reply.num_hit == 3 and reply.tiers == ["remote"] * 3
        reg = cb.register(dst.layout, "engine-b")
        assert cb.load(reg, reply.lease_id, range(3)) == 3
        cb.release(reply.lease_id)
        assert np.array_equal(dst.blocks[:3], src.blocks[:3])
        assert _remote_errors(b) == {"remote_errors_bad_block": 1}
        assert wait_until(lambda: _dram_at_rest(b, 3 * block_bytes), 5.0)
        # The liar is suspect now: asking for the rest costs no transfer.
        received = _stats(b)["cluster"]["client"]["blocks_received"]
        assert cb.lookup(chain.namespace, chain.hashes, chain.idents,
                         lease_ttl_s=0).num_hit == 3
        assert _stats(b)["cluster"]["client"]["blocks_received"] == received


def test_paused_redis_costs_bounded_waits_and_sharing_resumes(start_node, redis_server) -> None:
    a, b = _start_pair(start_node)
    with a.client() as ca:
        ca.put(b"before", random_bytes(100_000, 1))
    assert wait_until(lambda: _published(a, 1), 10.0)

    redis_server.pause()
    try:
        with a.client(timeout_s=10.0) as ca, b.client(timeout_s=10.0) as cb:
            start = time.monotonic()
            assert cb.get(b"before") is None  # the index does not answer: a miss, in time
            assert time.monotonic() - start < 0.5 + SLACK_S  # redis_timeout_s is 0.5 s
            start = time.monotonic()
            ca.put(b"during", random_bytes(100_000, 2))  # published once Redis answers
            assert ca.get(b"during") == random_bytes(100_000, 2)
            cb.put(b"local", b"x" * 1000)
            assert cb.get(b"local") == b"x" * 1000
            assert time.monotonic() - start < 0.5
            assert wait_until(lambda: _stats(b)["cluster"]["index"]["state"] == "down", 5.0)
            start = time.monotonic()
            assert cb.get(b"during") is None  # index down: no wait on Redis at all
            assert time.monotonic() - start < 0.2
    finally:
        redis_server.resume()
    assert wait_until(lambda: _published(a, 2) and _sees(b, 2), 15.0)
    with b.client() as cb:
        assert cb.get(b"before") == random_bytes(100_000, 1)
        assert cb.get(b"during") == random_bytes(100_000, 2)
    assert _stats(b)["cluster"]["index"]["redis_down_events"] >= 1


def test_flushed_redis_nodes_register_again_and_republish(start_node, redis_server) -> None:
    a, b = _start_pair(start_node)
    values = {b"f%d" % i: random_bytes(50_000, 10 + i) for i in range(5)}
    with a.client() as ca:
        for key, value in values.items():
            ca.put(key, value)
    assert wait_until(lambda: _published(a, len(values)), 10.0)

    r = redis_server.client()
    assert r.flushall()
    assert r.keys("*") == []
    with b.client() as cb:
        start = time.monotonic()
        assert cb.get(b"f0") is None  # no entry any more: a plain miss, no error
        assert time.monotonic() - start < 0.5
    # The next heartbeat finds the registration gone: each node registers again and a
    # re-publishes everything it holds; b finds the values again.
    assert wait_until(lambda: r.exists("kvstore:n:a") and r.exists("kvstore:n:b"), 5.0)
    with b.client() as cb:
        assert wait_until(lambda: cb.get(b"f1") is not None, 5.0)
        for key, value in values.items():
            assert cb.get(key) == value
    assert _stats(a)["cluster"]["index"]["resyncs"] >= 1
    assert not _remote_errors(b)
