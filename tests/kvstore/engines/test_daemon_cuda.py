"""GPU: a real `kvstore serve` moves blocks between an engine's CUDA arena and its pinned pool.

The test process plays the engine: it allocates a block-major arena with plain cudaMalloc (an IPC
handle names a whole allocation, so not from CuPy's pool), registers it by IPC handle, saves,
scrambles its arena, looks up and loads into other block ids, and compares bytes. An engine process
that dies mid-save must leave the daemon serving, with its accounting intact.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from support.arena import CudaArena

from kvstore.keys import Namespace, block_hashes, block_ident
from kvstore.layout import KVLayout, Region
from kvstore.wire.client import Client, ClientError

pytestmark = pytest.mark.gpu

REPO_ROOT = Path(__file__).resolve().parents[3]
BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2  # Qwen3-4B: layers x K,V x tokens x KV heads x dim x bf16
NUM_BLOCKS = 64


# ------------------------------------------------------------------------------ helpers


@dataclass
class _Daemon:
    proc: subprocess.Popen
    socket_path: Path
    lines: list[str] = field(default_factory=list)

    def client(self) -> Client:
        return Client(self.socket_path, timeout_s=60.0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.socket_path.parent, ignore_errors=True)
        return self.proc.returncode


def _start_daemon(*extra: str, dram: str = "1GiB") -> _Daemon:
    socket_path = Path(tempfile.mkdtemp(prefix="kvs-gpu-")) / "kvstore.sock"
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_SOCKET"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                             str(socket_path), "--dram", dram, "--http", "off", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, env=env)
    daemon = _Daemon(proc, socket_path)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            daemon.lines.append(line.rstrip("\n"))
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 60.0
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise RuntimeError("daemon not ready:\n" + "\n".join(daemon.lines)) from None
        if line is None:
            raise RuntimeError(f"daemon exited {proc.wait()}:\n" + "\n".join(daemon.lines))
        if "kvstore: ready" in line:
            return daemon


def _arena(num_blocks: int, seed: int) -> CudaArena:
    """An engine-like KV arena: ``kv[num_blocks, BLOCK_BYTES]`` in its own cudaMalloc."""
    return CudaArena(num_blocks, BLOCK_BYTES, seed, generations=False,
                     meta={"num_layers": 36, "block_size": 16, "num_kv_heads": 8,
                           "head_dim": 128})


def _chain(name: str, num_blocks: int, seed: int = 0) -> tuple[bytes, list[bytes], list[bytes]]:
    namespace = Namespace(name=name).digest
    tokens = np.random.default_rng(seed).integers(0, 50_000, num_blocks * 16)
    hashes = block_hashes(namespace, tokens, 16)
    parents = [namespace, *hashes[:-1]]
    idents = [block_ident(parents[i], tokens[i * 16:(i + 1) * 16]) for i in range(num_blocks)]
    return namespace, hashes, idents


def _settle(client: Client, predicate, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon():
    running = _start_daemon(dram="1GiB")
    yield running
    code = running.stop()
    assert code == 0, "daemon did not exit cleanly:\n" + "\n".join(running.lines)


# -------------------------------------------------------------------------------- tests


def test_save_scramble_load_into_other_blocks_is_byte_exact(daemon: _Daemon) -> None:
    arena = _arena(NUM_BLOCKS, seed=1)
    rng = np.random.default_rng(2)
    # Scattered ids (one copy each) and a consecutive run (coalesced copies).
    save_ids = [int(b) for b in rng.permutation(48)[:24]] + list(range(48, 56))
    namespace, hashes, idents = _chain("gpu-round-trip", len(save_ids))
    expect = arena.blocks(save_ids)
    with daemon.client() as c:
        assert c.stats()["tiers"]["dram"]["pinned"] is True
        timed_before = c.stats()["daemon"]["copy_ms"]  # the daemon serves other tests too
        reg = c.register(arena.layout, "gpu-engine")
        reply = c.save(reg, namespace, save_ids, hashes, idents)
        assert reply.outcomes == ["saved"] * len(save_ids)
        assert c.save(reg, namespace, save_ids, hashes, idents).outcomes == \
            ["duplicate"] * len(save_ids)

        arena.fill(seed=3)
        before = arena.kv.get()
        hit = c.lookup(namespace, hashes, idents)
        assert hit.num_hit == len(save_ids) and set(hit.tiers) == {"dram"}
        load_ids = [int(b) for b in rng.permutation(NUM_BLOCKS)[:len(save_ids)]]
        assert c.load(reg, hit.lease_id, load_ids) == len(save_ids)
        after = arena.kv.get()
        assert np.array_equal(after[load_ids], expect)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(load_ids))
        assert np.array_equal(after[untouched], before[untouched])

        stats = c.stats()
        assert stats["leases"] == 0 and stats["daemon"]["leases_active"] == 0
        assert stats["tiers"]["dram"]["in_flight_blocks"] == 0
        # The saves and the load timed by phase (``daemon.copy_ms``).
        timing = stats["daemon"]["copy_ms"]
        added = {way: {k: v - timed_before.get(way, {}).get(k, 0) for k, v in sums.items()}
                 for way, sums in timing.items()}
        assert added["save"]["calls"] == 2 and added["load"]["calls"] == 1
        assert added["load"]["chunks"] >= 1 and added["load"]["ms_total"] > 0
        for way in ("save", "load"):
            parts = added[way]
            assert parts["ms_to_first_submit"] <= parts["ms_total"] + 1e-3
            assert parts["ms_store"] <= parts["ms_total"] + 1e-3
        assert c.unregister(reg) is True
        assert c.stats()["daemon"]["registrations"] == 0


def test_copy_flags_reach_the_daemons_copier(daemon: _Daemon) -> None:
    """``--copy-packed-min-pieces 1 --copy-chunk-size 0 --copy-load-chunk-size 0
    --copy-save-kernels``: kvengine's one-piece blocks go packed (by default only layouts of 2+
    pieces do, and saves never), each request as one submission: one packed batch for the save
    and one for the load, byte-exact; the default daemon packs none of them."""
    arena = _arena(NUM_BLOCKS, seed=6)
    save_ids = [int(b) for b in np.random.default_rng(7).permutation(NUM_BLOCKS)[:24]]
    load_ids = [int(b) for b in np.random.default_rng(8).permutation(NUM_BLOCKS)[:24]]
    tuned = _start_daemon("--copy-packed-min-pieces", "1", "--copy-chunk-size", "0",
                          "--copy-load-chunk-size", "0", "--copy-save-kernels")
    try:
        for running, packed in ((tuned, 2), (daemon, 0)):
            namespace, hashes, idents = _chain(f"gpu-copy-flags-{packed}", len(save_ids))
            expect = arena.blocks(save_ids)
            with running.client() as c:
                before = c.stats()["daemon"]["copies"].get("batches_packed", 0)
                reg = c.register(arena.layout, "gpu-engine")
                assert c.save(reg, namespace, save_ids, hashes, idents).num_saved == 24
                arena.fill(seed=9)
                hit = c.lookup(namespace, hashes, idents)
                assert c.load(reg, hit.lease_id, load_ids) == 24
                assert np.array_equal(arena.blocks(load_ids), expect)
                after = c.stats()["daemon"]["copies"].get("batches_packed", 0)
                assert after - before == packed
                c.remove(namespace, hashes)
                assert c.unregister(reg) is True
    finally:
        assert tuned.stop() == 0, "daemon did not exit cleanly:\n" + "\n".join(tuned.lines)


def test_cuda_registration_and_block_id_errors(daemon: _Daemon) -> None:
    arena = _arena(8, seed=4)
    good = arena.layout
    region = good.regions[0]
    with daemon.client() as c:
        for bad_handle in (b"\x00" * 64, b"\x01" * 10):
            bad = KVLayout(8, (Region(bad_handle, region.size_bytes, 0, BLOCK_BYTES,
                                      BLOCK_BYTES),), device="cuda:0")
            with pytest.raises(ClientError) as info:
                c.register(bad, "e")
            assert info.value.code == "bad_request" and "CUDA IPC" in info.value.message
        with pytest.raises(ClientError) as info:
            c.register(KVLayout(8, good.regions, device="cuda:99"), "e")
        assert info.value.code == "bad_request"
        # A handle is registered once while that registration lives: a second one is
        # refused, and freed again by unregistering.
        reg_a = c.register(good, "e")
        with pytest.raises(ClientError) as info:
            c.register(good, "e")
        assert info.value.code == "permission_denied" and "registered" in info.value.message
        namespace, hashes, idents = _chain("gpu-errors", 2)
        with pytest.raises(ClientError) as info:
            c.save(reg_a, namespace, [0, 8], hashes, idents)
        assert info.value.code == "bad_request"
        assert c.unregister(reg_a) is True
        reg_b = c.register(good, "e")
        assert c.save(reg_b, namespace, [0, 7], hashes, idents).num_saved == 2
        arena.kv[0] = 0
        arena.kv[7] = 0
        hit = c.lookup(namespace, hashes, idents)
        assert c.load(reg_b, hit.lease_id, [7, 0]) == 2  # reg_a's unmap freed the handle
        assert c.health()["status"] == "ok"
    # Saved from blocks (0, 7) and loaded back into (7, 0): the arena's two blocks swapped.
    fresh = _arena(8, seed=4)
    assert np.array_equal(arena.blocks([7, 0]), fresh.blocks([0, 7]))


def test_load_promotes_ssd_blocks_and_stays_byte_exact(tmp_path: Path) -> None:
    daemon = _start_daemon("--ssd-dir", str(tmp_path / "ssd"), "--ssd-size", "1GiB",
                           dram="128MiB")
    try:
        arena = _arena(NUM_BLOCKS, seed=5)
        first_ids, second_ids = list(range(40)), list(range(40, 60))
        ns, hashes, idents = _chain("gpu-ssd", 60)
        expect = arena.blocks(first_ids)
        with daemon.client() as c:
            reg = c.register(arena.layout, "gpu-engine")
            # 40 + 20 blocks (141 MB) overflow the 128 MiB pool: the oldest go to SSD.
            assert c.save(reg, ns, first_ids, hashes[:40], idents[:40]).num_saved == 40
            assert c.save(reg, ns, second_ids, hashes[40:], idents[40:]).num_saved == 20
            stats = _settle(c, lambda s: s["tiers"]["ssd"]["blocks"] >= 10)
            assert stats["tiers"]["ssd"]["blocks"] >= 10
            arena.fill(seed=6)
            hit = c.lookup(ns, hashes[:40], idents[:40])
            assert hit.num_hit == 40 and "ssd" in hit.tiers
            load_ids = list(range(63, 23, -1))
            assert c.load(reg, hit.lease_id, load_ids) == 40
            assert np.array_equal(arena.blocks(load_ids), expect)
            stats = c.stats()
            assert stats["counters"]["promotions"] >= 1 and stats["leases"] == 0
    finally:
        assert daemon.stop() == 0, "\n".join(daemon.lines)


_DYING_ENGINE = textwrap.dedent("""
    import os, sys, time
    import cupy as cp
    sys.path.insert(0, {tests!r})
    sys.path.insert(0, {tests_root!r})
    from test_daemon_cuda import _arena, _chain
    from kvstore.wire.client import Client
    arena = _arena({num_blocks}, seed=7)
    ns, hashes, idents = _chain("gpu-dying", {num_blocks})
    client = Client({socket!r}, timeout_s=60.0)
    reg = client.register(arena.layout, "dying-engine")
    client.save_async(reg, ns, list(range({num_blocks})), hashes, idents)
    time.sleep({delay_s})
    os._exit(0)
""")


@pytest.mark.parametrize("delay_s", [0.0, 0.01])
def test_engine_killed_mid_save_leaves_daemon_healthy(delay_s: float) -> None:
    daemon = _start_daemon(dram="2GiB")
    try:
        num_blocks = 512  # 1.2 GB: a save that runs for tens of milliseconds
        script = _DYING_ENGINE.format(tests=str(Path(__file__).parent),
                                      tests_root=str(REPO_ROOT / "tests"), num_blocks=num_blocks,
                                      socket=str(daemon.socket_path), delay_s=delay_s)
        child = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, timeout=120,
                               capture_output=True, text=True)
        assert child.returncode == 0, child.stderr
        with daemon.client() as c:
            stats = _settle(c, lambda s: s["daemon"]["registrations"] == 0
                            and s["daemon"]["connections"] == 1
                            and s["tiers"]["dram"]["in_flight_blocks"] == 0)
            dram, events = stats["tiers"]["dram"], stats["daemon"]["events"]
            print(f"delay {delay_s}: saved {events.get('blocks_saved', 0)}, failed "
                  f"{events.get('blocks_save_failed', 0)}, DRAM blocks {dram['blocks']}, "
                  f"requests {stats['daemon']['requests']}, errors {stats['daemon']['errors']}")
            assert stats["daemon"]["registrations"] == 0
            assert stats["daemon"]["leases_active"] == 0 and stats["leases"] == 0
            assert dram["in_flight_blocks"] == 0
            assert dram["used_bytes"] == dram["blocks"] * BLOCK_BYTES  # nothing leaked
            assert dram["blocks"] == events.get("blocks_saved", 0)
            assert c.health()["status"] == "ok"
            # The daemon's CUDA context still works: a fresh engine round-trips its blocks.
            arena = _arena(8, seed=8)
            ns, hashes, idents = _chain("gpu-after-crash", 4)
            expect = arena.blocks([0, 1, 2, 3])
            reg = c.register(arena.layout, "next-engine")
            assert c.save(reg, ns, [0, 1, 2, 3], hashes, idents).num_saved == 4
            arena.fill(seed=9)
            hit = c.lookup(ns, hashes, idents)
            assert c.load(reg, hit.lease_id, [4, 5, 6, 7]) == 4
            assert np.array_equal(arena.blocks([4, 5, 6, 7]), expect)
    finally:
        assert daemon.stop() == 0, "\n".join(daemon.lines)
