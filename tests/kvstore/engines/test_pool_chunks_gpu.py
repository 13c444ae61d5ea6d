"""GPU: copies land whatever the pool's size (blocks in every pinned chunk and beside each
boundary), and a sticky CUDA error fails the daemon closed.

Measured on an H200 (2026-11-28) before the fix: with the pool pinned in two chunks, a batch
whose host side ran from the last blocks of one chunk into the first of the next went out as one
coalesced copy and the driver refused it (``cudaErrorInvalidValue``): more than half of a node's
saves failed once its pool passed 64 GiB. The chunk size is a parameter, so the first test
places blocks around several boundaries of a small pool; the second fills a real daemon's pool
past 64 GiB where the host has the memory.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.arena import CudaArena

from kvstore.engines.copy_bounds import HostSpans
from kvstore.layout import KVLayout, Region
from kvstore.store.dram.host_memory import available_bytes
from kvstore.wire.replies import ClientError, DaemonUnavailable

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).parent))
from test_daemon_cuda import BLOCK_BYTES, _chain, _start_daemon  # noqa: E402

GiB = 1 << 30


@pytest.mark.parametrize("method", ["staged", "kernel", "batch", "memcpy"])
def test_every_method_lands_in_every_chunk_and_beside_each_boundary(method: str) -> None:
    """Fill a pool pinned in 5 chunks with consecutive allocations (so neighbours across a
    boundary would coalesce), save a shuffled arena into all of them and load it back."""
    import cupy as cp

    from kvstore.engines.copier import CudaCopier
    from kvstore.engines.copy_settings import CopySettings
    from kvstore.engines.run_arrays import RunArrays
    from kvstore.store.dram.pool import HostPool

    chunk = 64 << 20
    pool = HostPool(5 * chunk, pin=True, chunk_bytes=chunk)
    try:
        assert pool.pinned and len(pool.spans()) == 5
        allocs = []
        while (a := pool.allocate(BLOCK_BYTES)) is not None:
            allocs.append(a)
        pool.check_integrity()
        host = np.array([pool.address(a) for a in allocs], dtype=np.int64)
        spans = HostSpans(pool.spans())
        spans.check(host, BLOCK_BYTES)  # none crosses a boundary
        starts = [s for s, _ in pool.spans()]
        assert {int(np.searchsorted(starts, h, side="right")) for h in host} == {1, 2, 3, 4, 5}
        n = len(allocs)
        arena = CudaArena(n, BLOCK_BYTES, seed=11, generations=False)
        back = CudaArena(n, BLOCK_BYTES, seed=None, generations=False)
        order = np.random.default_rng(12).permutation(n).astype(np.int64)
        dev = arena.memory.ptr + order * BLOCK_BYTES
        size = np.full(n, BLOCK_BYTES, dtype=np.int64)
        copier = CudaCopier(0, CopySettings(small_runs=method, large_runs=method,
                                            save_kernels=True))
        for consecutive in (False, True):  # shuffled device side, then one long run each side
            d = arena.memory.ptr + np.arange(n, dtype=np.int64) * BLOCK_BYTES \
                if consecutive else dev
            copier.device_to_host(RunArrays(d, host, size)).wait()
            b = back.memory.ptr + (d - arena.memory.ptr)
            copier.host_to_device(RunArrays(host, b, size)).wait()
            cp.cuda.Device().synchronize()
            assert np.array_equal(back.kv.get(), arena.kv.get())
            back.fill(None)
        if method == "staged":  # the shuffled restore from continuing slots went staged
            assert copier.counts["load_staged"] >= 1, copier.counts
    finally:
        pool.close()


def _fill_and_check(daemon, arena: CudaArena, target_bytes: int) -> None:
    """Save distinct blocks until the pool holds ``target_bytes``; every save lands, and blocks
    from the first, the boundary-crossing and the last rounds load back byte-exact."""
    per_round = arena.num_blocks
    rounds = -(-target_bytes // (per_round * BLOCK_BYTES))
    ids = list(range(per_round))
    kept = {}
    with daemon.client() as c:
        reg = c.register(arena.layout, "big-pool")
        for r in range(rounds):
            arena.fill(seed=100 + r)
            namespace, hashes, idents = _chain(f"big-pool-{r}", per_round, seed=r)
            reply = c.save(reg, namespace, ids, hashes, idents)
            assert reply.outcomes == ["saved"] * per_round, f"round {r}: {reply.outcomes}"
            if r in (0, rounds // 2, (64 * GiB) // (per_round * BLOCK_BYTES), rounds - 1):
                kept[r] = (namespace, hashes, idents, arena.kv.get())
        stats = c.stats()["tiers"]["dram"]
        assert stats["used_bytes"] >= min(target_bytes, 64 * GiB + per_round * BLOCK_BYTES)
        for r, (namespace, hashes, idents, expect) in kept.items():
            arena.fill(None)
            hit = c.lookup(namespace, hashes, idents)
            assert hit.num_hit == per_round, f"round {r}: hit {hit.num_hit}"
            assert c.load(reg, hit.lease_id, ids) == per_round
            assert np.array_equal(arena.kv.get(), expect), f"round {r}"
        c.unregister(reg)


def test_daemon_pool_past_64_gib_saves_and_loads_every_block() -> None:
    """A 72 GiB pool (two pinned chunks) filled to the brim: zero failed saves, zero copy
    errors in the daemon's log, blocks from both chunks byte-exact."""
    dram = 72 * GiB
    available = available_bytes()
    if available is None or available[0] < dram + 24 * GiB:
        pytest.skip(f"needs {dram // GiB + 24} GiB of free host memory")
    daemon = _start_daemon(dram="72GiB")
    try:
        _fill_and_check(daemon, CudaArena(512, BLOCK_BYTES, seed=1, generations=False),
                        dram - 2 * GiB)
        errors = [line for line in daemon.lines if "ERROR" in line or "failed" in line]
        assert not errors, "\n".join(errors)
    finally:
        assert daemon.stop() == 0, "\n".join(daemon.lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("wait", [(), ("--copy-wait-poll-us", "20")], ids=["blocking", "polled"])
def test_a_sticky_cuda_error_fails_the_daemon_closed_and_the_next_one_serves(
        wait: tuple[str, ...]) -> None:
    """A registration addressed past its mapping (the daemon's test hook) makes the copy kernel
    read an illegal address: the save fails, /health says failing with the reason, the error is
    logged once, the daemon exits with status 70, and a new daemon on the same socket serves.
    Whichever way the copier waits for a batch (blocking in the event, or polling it first)."""
    import cupy as cp

    from kvstore.engines.cuda_fault import EXIT_CUDA_POISONED

    n, half = 32, BLOCK_BYTES // 2
    arena = CudaArena(n, BLOCK_BYTES, seed=5, generations=False)
    handle = bytes(cp.cuda.runtime.ipcGetMemHandle(arena.memory.ptr))
    # Two pieces a block (K and V halves): the packed path's copy_pieces kernel moves them.
    layout = KVLayout(n, (Region(handle, n * BLOCK_BYTES, 0, BLOCK_BYTES, half),
                          Region(handle, n * BLOCK_BYTES, half, BLOCK_BYTES, half)),
                      device="cuda:0", dtype="bfloat16")
    port = _free_port()
    os.environ["KVSTORE_DEBUG_CORRUPT_ENGINE"] = "poisoned-engine"
    try:
        # --copy-save-kernels: the save packs (a copy engine's fault is not sticky)
        daemon = _start_daemon("--http", f"127.0.0.1:{port}", "--copy-save-kernels", *wait)
    finally:
        del os.environ["KVSTORE_DEBUG_CORRUPT_ENGINE"]
    namespace, hashes, idents = _chain("poisoned", n)
    try:
        with daemon.client() as c:
            reg = c.register(layout, "poisoned-engine")
            try:
                reply = c.save(reg, namespace, list(range(n)), hashes, idents)
            except (ClientError, DaemonUnavailable) as exc:  # the daemon's log says why
                raise AssertionError(f"{exc}\n" + "\n".join(daemon.lines)) from exc
            assert reply.num_saved == 0
            status, body = _health(port)
            assert status == 503 and body["status"] == "failing", body
            assert body["cuda"]["state"] == "poisoned" and "illegal" in body["cuda"]["reason"]
            assert c.health()["status"] == "failing"
            again = c.save(reg, namespace, list(range(n)), hashes, idents)
            assert again.num_saved == 0
        assert daemon.proc.wait(30) == EXIT_CUDA_POISONED
        sticky = [line for line in daemon.lines if "sticky CUDA error" in line]
        assert len(sticky) == 1, "\n".join(daemon.lines)
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
    # The supervisor's restart: a fresh daemon saves and loads the same engine memory.
    fresh = _start_daemon()
    try:
        with fresh.client() as c:
            reg = c.register(layout, "healthy-engine")
            assert c.save(reg, namespace, list(range(n)), hashes, idents).num_saved == n
            expect = arena.kv.get()
            arena.fill(None)
            hit = c.lookup(namespace, hashes, idents)
            assert hit.num_hit == n
            assert c.load(reg, hit.lease_id, list(range(n))) == n
            got = arena.kv.get()
            wrong = [b for b in range(n) if not np.array_equal(got[b], expect[b])]
            assert not wrong, f"blocks {wrong} differ"
    finally:
        assert fresh.stop() == 0, "\n".join(fresh.lines)
