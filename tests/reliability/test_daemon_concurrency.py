"""Several engine and client processes hitting the same keys and blocks of one daemon at once.

The daemon runs in this process (real Daemon, Service and TieredStore, small DRAM over an SSD
tier, so demotion and promotion run under the traffic) and ``check_integrity()`` is asserted
after. Three child processes with two threads each: all save the same chain of blocks at the same
moment (exactly one save of each block counts as "saved", every other is a duplicate), then mix
puts of shared keys (idempotent), puts of contested keys (each process its own value), gets,
lookups, loads and removes. Nothing read is ever other bytes, nothing is lost, nothing is freed
twice, and the pool's accounting is back to a clean state at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from daemon_helpers import REPO_ROOT, make_chain, random_bytes, wait_until
from reliability_helpers import InProcessDaemon

from kvstore.store.tiered import StoreConfig

pytestmark = pytest.mark.timeout(120)

NUM_PROCS, NUM_THREADS = 3, 2
NUM_BLOCKS, BLOCK_BYTES = 24, 64 * 1024
NUM_SHARED, NUM_CONTESTED = 32, 8
TESTS_DIR = Path(__file__).resolve().parents[1]

_CLIENT = textwrap.dedent("""
    import json, random, sys, threading, time
    from daemon_helpers import make_chain, random_bytes
    from reliability_helpers import guarded_arena
    from kvstore.wire.client import Client

    sock, proc, seed, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    NUM_BLOCKS, BLOCK_BYTES, NUM_SHARED, NUM_CONTESTED, NUM_PROCS, SECONDS = map(
        int, sys.argv[5:11])
    chain = make_chain("concurrency", NUM_BLOCKS, seed=9)
    shared = lambda i: random_bytes(1000 + 997 * i, seed=10_000 + i)
    contested = lambda i, p: random_bytes(3000 + 101 * i, seed=20_000 + 100 * i + p)
    out = {"saved": 0, "duplicate": 0, "failed": 0, "wrong": [], "errors": [], "ops": 0,
           "loaded": 0}
    lock = threading.Lock()

    def note(key, value):
        with lock:
            out[key] += value

    def wait_for(path):
        while True:  # the test starts every thread's next phase at the same moment
            try:
                open(path).close()
                return
            except FileNotFoundError:
                time.sleep(0.001)

    def worker(t):
        rng = random.Random(proc * 100 + t)
        # Every engine's own memory (a memory is registered once), with the test's blocks.
        src = guarded_arena(NUM_BLOCKS, BLOCK_BYTES, seed=seed)
        dst = guarded_arena(NUM_BLOCKS, BLOCK_BYTES, seed=None)
        try:
            with Client(sock, timeout_s=30.0) as c:
                reg_src = c.register(src.layout, f"engine-{proc}-{t}")
                reg_dst = c.register(dst.layout, f"engine-{proc}-{t}-dst")
                wait_for(go + "-save")
                res = c.save(reg_src, chain.namespace, range(NUM_BLOCKS), chain.hashes,
                             chain.idents)
                for outcome in res.outcomes:
                    note(outcome, 1)
                open(f"{go}-saved-{proc}-{t}", "w").close()
                wait_for(go + "-churn")
                end = time.monotonic() + SECONDS
                while time.monotonic() < end:
                    op = rng.random()
                    if op < 0.25:
                        i = rng.randrange(NUM_SHARED)
                        c.put(b"shared-%d" % i, shared(i))
                    elif op < 0.35:
                        i = rng.randrange(NUM_CONTESTED)
                        c.put(b"contested-%d" % i, contested(i, proc))
                    elif op < 0.55:
                        i = rng.randrange(NUM_SHARED)
                        got = c.get(b"shared-%d" % i)
                        if got is not None and got != shared(i):
                            out["wrong"].append(f"shared {i}")
                    elif op < 0.65:
                        i = rng.randrange(NUM_CONTESTED)
                        got = c.get(b"contested-%d" % i)
                        if got is not None and got not in [contested(i, p)
                                                           for p in range(NUM_PROCS)]:
                            out["wrong"].append(f"contested {i}")
                    elif op < 0.85:
                        start = rng.randrange(NUM_BLOCKS)
                        hit = c.lookup(chain.namespace, chain.hashes[start:],
                                       chain.idents[start:])
                        if hit.num_hit:
                            ids = rng.sample(range(NUM_BLOCKS), hit.num_hit)
                            n = c.load(reg_dst, hit.lease_id, ids)
                            note("loaded", n)
                            for b in range(n):
                                if dst.block(ids[b]) != src.block(start + b):
                                    out["wrong"].append(f"block {start + b}")
                    elif op < 0.93:
                        i = rng.randrange(NUM_BLOCKS)
                        c.remove(chain.namespace, [chain.hashes[i]])
                    else:
                        ids = sorted(rng.sample(range(NUM_BLOCKS), 4))
                        c.save(reg_src, chain.namespace, ids, [chain.hashes[i] for i in ids],
                               [chain.idents[i] for i in ids])
                    note("ops", 1)
                    if not dst.guards_intact():
                        out["wrong"].append("a guard byte changed")
                # Leave the chain whole: what a remove took is saved again.
                c.save(reg_src, chain.namespace, range(NUM_BLOCKS), chain.hashes, chain.idents)
        except Exception as exc:
            out["errors"].append(repr(exc))
        finally:
            src.close()
            dst.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out), flush=True)
""")


def test_concurrent_engines_and_clients_on_the_same_keys(arenas, tmp_path):
    daemon = InProcessDaemon(StoreConfig(dram_bytes=4 << 20, ssd_dir=tmp_path / "ssd",
                                         ssd_bytes=64 << 20))
    try:
        src = arenas(NUM_BLOCKS, BLOCK_BYTES, seed=9)
        chain = make_chain("concurrency", NUM_BLOCKS, seed=9)
        go = str(tmp_path / "go")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(TESTS_DIR / "reliability"), str(TESTS_DIR), str(REPO_ROOT)]))
        procs = [subprocess.Popen(
            [sys.executable, "-c", _CLIENT, str(daemon.socket_path), str(p), "9", go,
             str(NUM_BLOCKS), str(BLOCK_BYTES), str(NUM_SHARED), str(NUM_CONTESTED),
             str(NUM_PROCS), "2"],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for p in range(NUM_PROCS)]
        num_engines = NUM_PROCS * NUM_THREADS
        assert wait_until(lambda: len(daemon.service.registry) == 2 * num_engines,
                          timeout_s=30), "the clients did not all register"
        Path(go + "-save").touch()  # six engines save the same chain at the same moment
        assert wait_until(lambda: len(list(tmp_path.glob("go-saved-*"))) == num_engines,
                          timeout_s=30), "the engines did not all save"
        # Each block was stored exactly once; every other save of it was a duplicate.
        assert daemon.store.stats()["counters"]["puts"] == NUM_BLOCKS
        events = daemon.service.stats()["daemon"]["events"]
        assert events["blocks_saved"] == NUM_BLOCKS
        assert events["blocks_save_duplicate"] == (num_engines - 1) * NUM_BLOCKS
        daemon.store.check_integrity()
        Path(go + "-churn").touch()
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=90)
            assert proc.returncode == 0, stderr
            results.append(json.loads(stdout.strip().splitlines()[-1]))
        for r in results:
            assert not r["errors"] and not r["wrong"], r
            assert r["failed"] == 0
        assert sum(r["ops"] for r in results) > 100 and sum(r["loaded"] for r in results) > 0

        def settled() -> bool:
            stats = daemon.store.stats()
            return (daemon.service.stats()["daemon"]["connections"] == 0
                    and len(daemon.service.registry) == 0 and stats["leases"] == 0
                    and stats["tiers"]["dram"]["in_flight_blocks"] == 0
                    and stats["tiers"]["dram"]["demoting_blocks"] == 0
                    and stats["tiers"]["dram"]["promoting_blocks"] == 0)

        assert wait_until(settled, timeout_s=10), daemon.service.stats()
        store = daemon.store
        store.check_integrity()  # no double free, no leaked pin or allocation
        stats = store.stats()
        counters = stats["counters"]
        assert stats["tiers"]["dram"]["pinned_blocks"] == 0
        assert stats["tiers"]["ssd"]["pinned_blocks"] == 0
        assert counters["lookup_blocks"] == (counters["hit_blocks_dram"]
                                             + counters["hit_blocks_ssd"]
                                             + counters["miss_blocks"])
        # Nothing is lost: every shared key, every contested key (one process's value, whole)
        # and the whole chain (saved again by every engine at its end) are there.
        with daemon.client() as c:
            for i in range(NUM_SHARED):
                got = c.get(b"shared-%d" % i)
                assert got == random_bytes(1000 + 997 * i, seed=10_000 + i), i
            for i in range(NUM_CONTESTED):
                candidates = [random_bytes(3000 + 101 * i, seed=20_000 + 100 * i + p)
                              for p in range(NUM_PROCS)]
                assert c.get(b"contested-%d" % i) in candidates, i
            assert c.lookup(chain.namespace, chain.hashes, chain.idents,
                            lease_ttl_s=0).num_hit == NUM_BLOCKS
        for i in range(NUM_BLOCKS):
            assert store.get(chain.namespace, chain.hashes[i], chain.idents[i]) == src.block(i)
        assert src.guards_intact()
        store.check_integrity()
    finally:
        daemon.stop()
