"""A request with a chain of hundreds of thousands of blocks (inline verbs answer on the daemon's
event loop) is decoded and answered on a worker: the other clients' requests go on meanwhile."""

from __future__ import annotations

import threading
import time

import pytest
from daemon_helpers import RunningDaemon, make_chain
from support.arena import ShmArena

from kvstore.keys import Namespace
from kvstore.wire.verbs import pack_lookup

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 1_000_000  # a 96 MB frame


def test_a_long_lookup_does_not_stall_the_other_clients(daemon: RunningDaemon) -> None:
    namespace = Namespace(name="long-chain").digest
    hashes = [i.to_bytes(16, "little") for i in range(NUM_BLOCKS)]
    idents = [b"\x01" * 80] * NUM_BLOCKS
    took: list[float] = []
    probes: list[float] = []

    packed = {"namespace": namespace, **pack_lookup(hashes, idents)}  # joined before: the
    # probes time the daemon, not this process's GIL
    sent = threading.Event()

    def long_lookup() -> None:
        with daemon.client(timeout_s=60) as c:
            start = time.perf_counter()
            pending = c.request("lookup", packed)  # back once the frame is written
            sent.set()
            assert pending.wait()["num_hit"] == 0
            took.append(time.perf_counter() - start)

    with daemon.client() as prober:
        prober.health()
        worker = threading.Thread(target=long_lookup)
        worker.start()
        # Probes from when the frame is out: its encoding holds this process's GIL in one C
        # call (in a long session 0.3 s, which the first probe used to wait for).
        assert sent.wait(60)
        while worker.is_alive():
            start = time.perf_counter()
            prober.health()
            probes.append(time.perf_counter() - start)
            time.sleep(0.005)
        worker.join()
    assert took and len(probes) >= 5, (took, len(probes))
    # On the loop, the decode and the lookup held the probes for about half the lookup's time
    # (the rest is the client's encoding and the transfer); on a worker, for a few switch
    # intervals of the GIL: 0.08-0.11 of it on an idle 2-core runner, 0.30 once on a loaded one.
    assert max(probes) < 0.4 * took[0], (max(probes), took[0])


def test_a_long_publication_and_the_eviction_after_it_apply_in_the_order_sent(
        daemon: RunningDaemon) -> None:
    """``resident`` and ``evicted`` stay on the loop whatever their size: a 1,000-block
    publication (a frame over 64 KiB) and the eviction pipelined right behind it (a small
    frame) must not swap, or the index would list blocks the engine dropped."""
    arena = ShmArena(1_000, 4096, seed=None, generations=True)
    chain = make_chain("long-publication", 1_000, seed=3)
    ids = list(range(1_000))
    try:
        with daemon.client() as engine, daemon.client() as router:
            reg = engine.register(arena.layout, "long-publisher")
            for _ in range(3):
                published = engine.resident_async(reg, chain.namespace, ids, chain.hashes,
                                                  chain.idents, arena.allocate(ids))
                dropped = engine.evicted_async(chain.namespace, chain.hashes, reg)
                assert published.wait() == 1_000 and dropped.wait() == 1_000
                reply = router.locate(chain.namespace, chain.hashes, chain.idents)
                assert [e.num_hbm for e in reply.engines if e.registration_id == reg] == [0]
            assert engine.unregister(reg)
    finally:
        arena.close()


def test_a_long_prompts_locate_is_answered_on_the_loop_and_a_huge_chain_on_a_worker() -> None:
    """A router's locate of a 19k-token prompt (1,188 blocks, ~120 KB) went to a worker thread
    past 64 KiB, behind the engines' saves (25-80 ms on two H200s); it stays on the loop now,
    while a chain of tens of thousands of blocks still goes to a worker, and a publication
    stays on the loop whatever its size (its order is its meaning)."""
    from kvstore.daemon.server import answered_on_loop
    from kvstore.wire import protocol as proto

    hashes = [i.to_bytes(16, "little") for i in range(1188)]
    idents = [b"\x01" * 84] * 1188
    frame = proto.encode_frame({"v": 1, "id": 1, "verb": "locate",
                                "args": {"namespace": b"n" * 16, **pack_lookup(hashes, idents)}})
    body_bytes = sum(len(piece) for piece in frame)
    assert body_bytes > 100_000 and answered_on_loop("locate", body_bytes)
    assert answered_on_loop("lookup", body_bytes)
    assert not answered_on_loop("locate", 2_000_000)
    assert answered_on_loop("resident", 50_000_000)
    assert not answered_on_loop("save", 100)
