"""`kill -9` of a real `kvstore serve` at random points of a put/demote/evict workload.

Small DRAM and a small SSD: puts demote to SSD in the background, the SSD evicts, a client
removes keys, and an engine (an ``StoreClient`` over a shared-memory arena) saves blocks,
all while the daemon is killed with SIGKILL at a random moment. After each kill: the SSD tier
opens with its LMDB index intact and in agreement (``check_integrity``), every block served
afterwards is byte-exact (a get is the bytes put or None), the restarted daemon is healthy, and
the engine's store client reconnects, re-registers and restores byte-exact blocks.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest
import xxhash
from daemon_helpers import make_chain, random_bytes

from kvstore.keys import Namespace
from kvstore.store.tiered import StoreConfig, TieredStore
from kvstore.wire.client import DaemonUnavailable
from offload.store_client import StoreClient

pytestmark = pytest.mark.timeout(180)

DRAM, SSD = "2MiB", "8MiB"
ROUNDS = 3
DEFAULT_NS = Namespace(name="default").digest
ARENA_BLOCKS, ENGINE_BLOCK_BYTES, CHAIN_BLOCKS = 64, 64 * 1024, 8  # blocks 32..63: load targets


def _key(i: int) -> bytes:
    return b"kill9-%d" % i


def _value(i: int) -> bytes:
    return random_bytes(48 * 1024 + (i * 7919 % 7) * 16 * 1024, seed=i)


def _chain(k: int):
    return make_chain(f"kill9-engine-{k}", CHAIN_BLOCKS, seed=k)


def _src_ids(k: int) -> list[int]:
    return [(3 * k + b) % 32 for b in range(CHAIN_BLOCKS)]


@dataclass
class Workload:
    """What the workload threads attempted (acknowledged or not) and what went wrong."""

    next_key: int = 0
    next_chain: int = 0
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _writer(daemon, work: Workload, seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    first = work.next_key
    try:
        with daemon.client(timeout_s=10.0) as c:
            while not stop.is_set():
                i = work.next_key
                work.next_key += 1  # attempted from here on: it may or may not be stored
                c.put(_key(i), _value(i))
                if i % 3 == 0:
                    j = rng.randrange(first, i + 1)
                    got = c.get(_key(j))
                    if got is not None and got != _value(j):
                        work.wrong.append(f"get {j} while running")
                if i % 7 == 0:
                    j = rng.randrange(i // 2, i + 1)
                    c.remove(DEFAULT_NS, [xxhash.xxh3_128_digest(_key(j))])
    except (DaemonUnavailable, ConnectionError):
        pass  # the kill
    except Exception as exc:  # a reply with an error, or a bug here: the test fails on it
        work.errors.append(repr(exc))


def _engine(client: StoreClient, work: Workload, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            k = work.next_chain
            work.next_chain += 1
            chain = _chain(k)
            transfer = client.save(chain.namespace, _src_ids(k), chain.hashes, chain.idents)
            transfer.wait()
            if not transfer.ok:
                stop.wait(0.05)  # the store is gone: the engine would recompute meanwhile
    except Exception as exc:  # the store client must turn every store failure into a result
        work.errors.append(repr(exc))


def _check_offline(ssd_dir, work: Workload, arena) -> int:
    """Open the killed daemon's SSD dir in this process: index intact and consistent, every
    block its own bytes or absent. Returns how many blocks it serves."""
    store = TieredStore(StoreConfig(dram_bytes=2 << 20, ssd_dir=ssd_dir, ssd_bytes=8 << 20))
    try:
        counters = store.stats()["tiers"]["ssd"]["counters"]
        # Entries are committed only after their bytes are synced: nothing points past the
        # data, nothing overlaps, and LMDB itself survives SIGKILL.
        assert counters["index_resets"] == 0 and counters["layout_resets"] == 0
        assert counters["lost_at_start"] == 0
        store.check_integrity()
        served = 0
        for i in range(work.next_key):
            got = store.get(DEFAULT_NS, xxhash.xxh3_128_digest(_key(i)), _key(i))
            assert got is None or got == _value(i), f"key {i} has other bytes"
            served += got is not None
        for k in range(work.next_chain):
            chain = _chain(k)
            for b, block_id in enumerate(_src_ids(k)):
                got = store.get(chain.namespace, chain.hashes[b], chain.idents[b])
                assert got is None or got == arena.block(block_id), f"chain {k} block {b}"
                served += got is not None
        store.check_integrity()
        return served
    finally:
        store.close()


def _check_daemon(daemon, work: Workload) -> int:
    with daemon.client(timeout_s=20.0) as c:
        assert c.health()["status"] == "ok"
        served = 0
        for i in range(work.next_key):
            got = c.get(_key(i))
            assert got is None or got == _value(i), f"key {i} has other bytes after restart"
            served += got is not None
        stats = c.stats()
        assert stats["daemon"]["leases_active"] == 0 and stats["leases"] == 0
    return served


def _check_engine(client: StoreClient, work: Workload, arena) -> int:
    """The client reconnects by itself; its restores are byte-exact."""
    dst_ids = list(range(32, 32 + CHAIN_BLOCKS))
    num_loaded = 0
    for k in range(work.next_chain):
        chain = _chain(k)
        lookup = client.lookup(chain.namespace, chain.hashes, chain.idents)
        assert lookup.wait() and lookup.ok
        hit = lookup.result
        if not hit.num_hit:
            continue
        arena.array[arena.block_offset(32):arena.block_offset(64)] = 0
        load = client.load(hit.lease_id, dst_ids[:hit.num_hit])
        assert load.wait() and load.ok
        for b in range(load.result):
            assert arena.block(dst_ids[b]) == arena.block(_src_ids(k)[b]), f"chain {k}/{b}"
        num_loaded += load.result
    return num_loaded


def test_kill9_at_random_points_then_restart(make_daemon, arenas, tmp_path):
    rng = random.Random(20261)
    ssd_dir = tmp_path / "ssd"
    arena = arenas(ARENA_BLOCKS, ENGINE_BLOCK_BYTES, seed=3)
    arena.array[arena.block_offset(32):arena.block_offset(64)] = 0
    daemon = make_daemon(dram=DRAM, ssd_dir=ssd_dir, ssd_size=SSD)
    socket_path = daemon.socket_path
    client = StoreClient(socket_path, arena.layout, "kill9-engine", timeout_s=10.0,
                         reconnect_interval_s=0.05)
    work = Workload()
    served_offline = served_after = loaded = 0
    for round_ in range(ROUNDS):
        stop = threading.Event()
        threads = [threading.Thread(target=_writer, args=(daemon, work, rng.random(), stop)),
                   threading.Thread(target=_engine, args=(client, work, stop))]
        for t in threads:
            t.start()
        stop.wait(rng.uniform(0.4, 1.2))
        daemon.kill9()  # no flush, no clean close, mid-put, mid-demotion, mid-save
        stop.set()
        for t in threads:
            t.join(30)
        assert not work.wrong and not work.errors, (work.wrong, work.errors)
        if round_ % 2 == 0:  # the dir exactly as the kill left it, before a daemon touches it
            served_offline += _check_offline(ssd_dir, work, arena)
        daemon = make_daemon(dram=DRAM, ssd_dir=ssd_dir, ssd_size=SSD, socket_path=socket_path)
        served_after += _check_daemon(daemon, work)
        connects = client.counters["connects"]
        loaded += _check_engine(client, work, arena)
        assert client.counters["connects"] == connects + 1  # reconnected and re-registered
    assert daemon.stop() == 0
    served_offline += _check_offline(ssd_dir, work, arena)
    client.close()
    # Not vacuous: the workload reached the SSD, and blocks came back after the kills.
    assert work.next_key > 50 and work.next_chain > 5
    assert served_after > 0 and loaded > 0 and served_offline > 0
