"""An engine process killed with SIGKILL mid-save, mid-load and mid-frame (CPU path).

The daemon runs in this process (the real Daemon, Service and TieredStore on a thread) so that
the test can call ``check_integrity()``; the engine is a real child process that registers a
shared-memory KV arena and sends the request, and is killed while the daemon copies. Afterwards:
no half-written block is visible (every stored block is byte-exact), the engine's leases and
mappings are gone, pool accounting is back to its baseline and the daemon serves the next engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from daemon_helpers import REPO_ROOT, make_chain, wait_until
from reliability_helpers import InProcessDaemon

from kvstore.store.tiered import StoreConfig

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS, BLOCK_BYTES = 384, 256 * 1024  # 96 MiB per save or load: tens of milliseconds
TRIES = 4  # attempts to land the kill in the middle of a copy
TESTS_DIR = Path(__file__).resolve().parents[1]

_ENGINE = textwrap.dedent("""
    import json, socket, struct, sys, time
    import msgpack
    from daemon_helpers import make_chain
    from kvstore.wire.client import Client
    from kvstore.layout import KVLayout, Region

    sock_path, mode, wire, num_blocks = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    wire, num_blocks, fd = json.loads(wire), int(num_blocks), int(sys.argv[5])
    layout = KVLayout(wire["num_blocks"], tuple(Region(**r) for r in wire["regions"]),
                      wire["device"], wire["dtype"], fds=(fd,))  # the arena's, inherited
    chain = make_chain("engine-kill9", num_blocks, seed=5)
    c = Client(sock_path, timeout_s=60.0)
    reg = c.register(layout, "doomed-engine")
    if mode == "save":
        c.save_async(reg, chain.namespace, list(range(num_blocks)), chain.hashes, chain.idents)
    elif mode == "load":
        hit = c.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == num_blocks, hit
        c.load_async(reg, hit.lease_id, list(range(num_blocks, 2 * num_blocks)))
    else:  # half a save frame, then death: the daemon must not act on a partial request
        body = msgpack.packb({"id": 99, "verb": "save", "args": {
            "registration_id": reg, "namespace": chain.namespace,
            "block_ids": list(range(num_blocks)), "hashes": chain.hashes,
            "idents": chain.idents}})
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(sock_path)
        raw.sendall(struct.pack("<I", len(body)) + body[:len(body) // 2])
    print("sent", flush=True)
    time.sleep(60)
""")


def _daemon(tier: str, ssd_dir: Path) -> InProcessDaemon:
    if tier == "dram":
        return InProcessDaemon(StoreConfig(dram_bytes=128 << 20))
    # A quarter of the blocks fit in DRAM: saves demote as they go, loads promote from SSD.
    return InProcessDaemon(StoreConfig(dram_bytes=24 << 20, ssd_dir=ssd_dir, ssd_bytes=160 << 20))


def _spawn(daemon: InProcessDaemon, mode: str, arena,
           num_blocks: int = NUM_BLOCKS) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT)]))
    return subprocess.Popen(
        [sys.executable, "-c", _ENGINE, str(daemon.socket_path), mode,
         json.dumps(arena.layout.to_wire()), str(num_blocks), str(arena.layout.fds[0])],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        pass_fds=arena.layout.fds)


def _kill_when(child: subprocess.Popen, started, timeout_s: float = 20.0) -> None:
    """SIGKILL the child as soon as ``started()`` sees the daemon copying for it."""
    line = child.stdout.readline()
    assert line.strip() == "sent", child.stderr.read()
    deadline = time.monotonic() + timeout_s
    while not started() and time.monotonic() < deadline:
        pass  # no sleep: the kill should land while the copy runs
    child.send_signal(signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL


def _settled(daemon: InProcessDaemon, verb: str) -> bool:
    """The dead engine's connection is gone and its ``verb`` call has ended."""
    stats = daemon.store.stats()
    requests = daemon.service.stats()["daemon"]["requests"]
    return (requests.get(verb, 0) == 1
            and len(daemon.service.registry) == 0 and daemon.service.num_leases() == 0
            and stats["leases"] == 0 and stats["tiers"]["dram"]["in_flight_blocks"] == 0
            and stats["tiers"]["dram"]["demoting_blocks"] == 0
            and stats["tiers"]["dram"]["promoting_blocks"] == 0
            and daemon.service.stats()["daemon"]["connections"] == 0)


def _check_after(daemon: InProcessDaemon, verb: str, arena, chain) -> int:
    """Everything the dead engine held is released; every stored block is whole. Returns how
    many blocks of the chain the store holds."""
    assert wait_until(lambda: _settled(daemon, verb), timeout_s=10), daemon.service.stats()
    store = daemon.store
    store.check_integrity()
    stats = store.stats()
    dram = stats["tiers"]["dram"]
    assert dram["pinned_blocks"] == 0 and stats["tiers"]["ssd"].get("pinned_blocks", 0) == 0
    assert dram["used_bytes"] == dram["blocks"] * BLOCK_BYTES  # one reserved size per block
    held = 0
    for i in range(len(chain.hashes)):
        got = store.get(chain.namespace, chain.hashes[i], chain.idents[i])
        assert got is None or got == arena.block(i), f"block {i} is not the engine's block"
        held += got is not None
    store.check_integrity()
    return held


def _next_engine_round_trip(daemon: InProcessDaemon, arenas) -> None:
    """The daemon still serves: a fresh engine saves and restores byte-exact blocks."""
    arena = arenas(8, BLOCK_BYTES, seed=77)
    chain = make_chain("after-the-crash", 4, seed=77)
    with daemon.client() as c:
        assert c.health()["status"] == "ok"
        reg = c.register(arena.layout, "next-engine")
        assert c.save(reg, chain.namespace, [0, 1, 2, 3], chain.hashes,
                      chain.idents).outcomes == ["saved"] * 4
        hit = c.lookup(chain.namespace, chain.hashes, chain.idents)
        assert c.load(reg, hit.lease_id, [4, 5, 6, 7]) == 4
        assert c.unregister(reg)
    assert [arena.block(i) for i in (4, 5, 6, 7)] == [arena.block(i) for i in range(4)]
    assert arena.guards_intact()


@pytest.fixture
def fine_switching():
    """Hand the GIL around often, so the poll, the event loop and the copy interleave finely."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(before)


def _mid_save(tier: str, ssd_dir: Path, arenas) -> bool:
    """One engine killed while the daemon saves its blocks; True if the kill landed mid-copy."""
    daemon = _daemon(tier, ssd_dir)
    try:
        arena = arenas(NUM_BLOCKS, BLOCK_BYTES, seed=1)
        chain = make_chain("engine-kill9", NUM_BLOCKS, seed=5)
        child = _spawn(daemon, "save", arena)
        _kill_when(child, lambda: daemon.store.stats()["counters"]["puts"] > 4)
        held = _check_after(daemon, "save", arena, chain)
        saved = daemon.store.stats()["counters"]["puts"]
        # Only blocks whose copy had finished were published (and are whole, checked above).
        assert held == saved  # and nothing stored was lost to the crash
        assert saved > 4 and arena.guards_intact()
        _next_engine_round_trip(daemon, arenas)
        daemon.store.check_integrity()
        return saved < NUM_BLOCKS
    finally:
        daemon.stop()


def _mid_load(tier: str, ssd_dir: Path, arenas) -> bool:
    """One engine killed while the daemon loads blocks into it; True if it landed mid-copy."""
    daemon = _daemon(tier, ssd_dir)
    try:
        arena = arenas(2 * NUM_BLOCKS, BLOCK_BYTES, seed=2)
        chain = make_chain("engine-kill9", NUM_BLOCKS, seed=5)
        with daemon.client() as c:  # the blocks a previous engine computed
            reg = c.register(arena.layout, "writer")
            assert c.save(reg, chain.namespace, range(NUM_BLOCKS), chain.hashes,
                          chain.idents).num_saved == NUM_BLOCKS
            assert c.unregister(reg)
        if tier == "ssd":
            tiers = daemon.store.lookup(chain.namespace, chain.hashes, chain.idents,
                                        lease_ttl_s=None).tiers
            assert tiers.count("ssd") > NUM_BLOCKS // 2
        base = daemon.store.stats()["counters"]["promotions"]

        def copying() -> bool:
            stats = daemon.store.stats()
            if tier == "ssd":
                return stats["counters"]["promotions"] > base + 4
            # Each copied block is let go of ("done") at once: fewer stay pinned.
            return 0 < stats["tiers"]["dram"]["pinned_blocks"] < NUM_BLOCKS - 4

        child = _spawn(daemon, "load", arena)
        _kill_when(child, copying)
        # The load consumed no stored data: every block is still there and still exact.
        assert _check_after(daemon, "load", arena, chain) == NUM_BLOCKS
        assert arena.guards_intact()
        _next_engine_round_trip(daemon, arenas)
        return daemon.service.stats()["daemon"]["events"]["blocks_loaded"] < NUM_BLOCKS
    finally:
        daemon.stop()


@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_engine_killed_mid_save(arenas, tier, tmp_path, fine_switching):
    # Every try checks everything; a kill that lands after the copy finished tries again.
    assert any(_mid_save(tier, tmp_path / f"ssd-{i}", arenas) for i in range(TRIES)), \
        "no kill landed in the middle of a save"


@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_engine_killed_mid_load(arenas, tier, tmp_path, fine_switching):
    # Every try checks everything; a kill that lands after the copy finished tries again.
    assert any(_mid_load(tier, tmp_path / f"ssd-{i}", arenas) for i in range(TRIES)), \
        "no kill landed in the middle of a load"


def test_engine_killed_mid_frame_changes_nothing(arenas, tmp_path):
    daemon = _daemon("dram", tmp_path)
    try:
        arena = arenas(16, BLOCK_BYTES, seed=3)
        chain = make_chain("engine-kill9", 16, seed=5)
        child = _spawn(daemon, "half-frame", arena, num_blocks=16)
        _kill_when(child, lambda: True)
        assert wait_until(lambda: _settled(daemon, "register"), timeout_s=10)
        assert _check_after(daemon, "register", arena, chain) == 0
        assert daemon.store.stats()["counters"]["puts"] == 0
        assert "save" not in daemon.service.stats()["daemon"]["requests"]
        _next_engine_round_trip(daemon, arenas)
    finally:
        daemon.stop()
