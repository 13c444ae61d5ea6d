"""The ``RestoreBridge`` contract, run against every bridge the scheduler may hold.

``NullRestores`` (no store) and ``EngineRestores`` (kvengine's, over a real ``kvstore serve``)
each pass the same tests, the way cachetools runs one test class against every cache: what the
scheduler relies on (``offload/bridge.py``), whichever bridge it was given. A sequence the bridge
takes (``start_restore`` says True) is given back by ``poll`` exactly once, ready or to queue
again, unless it was aborted; what a ready one restored is counted by tier; nothing is held once
every sequence left.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from block_simulation import make_seq
from daemon_helpers import wait_until
from support.arena import ShmArena

from engine.block_manager import BlockManager
from kvstore import Client
from offload.bridge import RestoreBridge, StoreBridge
from offload.engine_store import EngineStore, OffloadPolicy
from offload.engine_view import RestoreOutcome
from offload.idents import sequence_idents
from offload.null_bridge import NullStore
from offload.restore_policy import RestorePolicy
from offload.store_client import StoreClient

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE, BLOCK_BYTES, NUM_BLOCKS, CHAIN = 16, 4096, 32, 6
POLL_S = 10.0


def sequence(name: str, seed: int):
    """A request of CHAIN full blocks and one token more (the token left to compute)."""
    tokens = [(seed * 7919 + i * 31) % 5000 for i in range(CHAIN * BLOCK_SIZE + 1)]
    seq = make_seq(name, tokens)
    BlockManager(NUM_BLOCKS, BLOCK_SIZE).update_hashes(seq)
    return seq


def store_chain(socket_path, seed: int) -> None:
    """Another engine saved chain ``seed``'s CHAIN blocks."""
    seq = sequence("writer", seed)
    arena = ShmArena(CHAIN, BLOCK_BYTES)
    try:
        arena.blocks[:] = np.random.default_rng(seed).integers(0, 256, (CHAIN, BLOCK_BYTES),
                                                                dtype=np.uint8)
        with Client(socket_path) as c:
            reg = c.register(arena.layout, "bridge-contract-writer")
            reply = c.save(reg, seq.namespace_digest, list(range(CHAIN)),
                           seq.block_hashes[:CHAIN],
                           sequence_idents(seq, range(CHAIN), BLOCK_SIZE))
            assert reply.outcomes == ["saved"] * CHAIN
            c.unregister(reg)
    finally:
        arena.close()


class Bridge:
    """One bridge as the scheduler holds it, with what the tests ask of its world."""

    def __init__(self, bridge: StoreBridge, socket_path=None, arena: ShmArena | None = None,
                 client: StoreClient | None = None) -> None:
        self.bridge = bridge
        self.restores: RestoreBridge = bridge.restores
        self.socket_path = socket_path
        self._arena = arena
        self._client = client

    @property
    def has_store(self) -> bool:
        return self.socket_path is not None

    def store(self, seed: int) -> None:
        """The store holds chain ``seed`` (where there is a store)."""
        if self.has_store:
            store_chain(self.socket_path, seed)

    def num_leases(self) -> int:
        """Leases the daemon holds for anyone (0 without a store)."""
        if not self.has_store:
            return 0
        with Client(self.socket_path) as c:
            stats = c.stats()
            return stats["daemon"]["leases_active"] + stats["leases"]

    def holds_no_lease(self) -> bool:
        """Whether the daemon soon holds no lease while the step loop goes on polling (a
        lookup let go of before its reply came is released at a later poll)."""
        def polled_and_free() -> bool:
            self.restores.poll()
            return self.num_leases() == 0
        return wait_until(polled_and_free)

    def close(self) -> None:
        self.bridge.close()
        if self._arena is not None:
            self._arena.close()


@pytest.fixture(params=["null", "engine"])
def side(request, make_daemon) -> Iterator[Bridge]:
    if request.param == "null":
        made = Bridge(NullStore())
    else:
        daemon = make_daemon(dram="16MiB")
        arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES)
        client = StoreClient(daemon.socket_path, arena.layout, "bridge-contract", 3.0, 0.5)
        assert client.wait_available(5.0)
        bridge = EngineStore(client, BlockManager(NUM_BLOCKS, BLOCK_SIZE), BLOCK_BYTES,
                             OffloadPolicy.WRITE_THROUGH, RestorePolicy({"dram": 1e9}, 1e3),
                             always_restore=True)
        made = Bridge(bridge, daemon.socket_path, arena, client)
    yield made
    made.close()


def given_back(restores: RestoreBridge) -> Counter:
    """Poll until the bridge holds no sequence (at most POLL_S): how often each sequence came
    back ready (``ready:<id>``) or to queue again (``requeue:<id>``)."""
    seen: Counter = Counter()
    deadline = time.monotonic() + POLL_S
    while time.monotonic() < deadline:
        outcome = restores.poll()
        assert isinstance(outcome, RestoreOutcome)
        seen.update(f"ready:{s.request_id}" for s in outcome.ready)
        seen.update(f"requeue:{s.request_id}" for s in outcome.requeue)
        if restores.num_loading == 0:
            return seen
        restores.wait_for_progress(0.01)
    raise AssertionError(f"{restores.num_loading} restore(s) still held after {POLL_S} s")


def test_a_fresh_bridge_holds_nothing(side) -> None:
    r = side.restores
    assert (r.num_loading, r.num_waiting_for_blocks) == (0, 0)
    assert r.hit_tokens_by_tier == Counter()
    assert r.poll() == RestoreOutcome([], [])
    assert r.abort(sequence("stranger", 1)) is False
    started = time.monotonic()
    r.wait_for_progress(0.05)
    assert time.monotonic() - started < 1.0


def test_a_taken_sequence_is_given_back_once_with_its_tokens_counted(side) -> None:
    side.store(1)
    seq = sequence("a", 1)
    r = side.restores
    r.prefetch(seq, busy=False)
    taken = r.start_restore(seq, 0, busy=False)
    assert taken is side.has_store  # the store holds it: the bridge restores it
    assert r.num_loading == int(taken)
    seen = given_back(r) if taken else Counter()
    assert seq.offload_checked
    assert seen == Counter({"ready:a": 1} if taken else {})  # the whole chain is a hit
    restored = sum(seq.restored_tokens_by_tier.values())
    assert restored == (CHAIN * BLOCK_SIZE if taken else 0)
    assert sum(r.hit_tokens_by_tier.values()) == restored
    assert side.holds_no_lease()


def test_a_miss_is_never_given_back_ready(side) -> None:
    seq = sequence("miss", 2)  # nobody stored it
    r = side.restores
    taken = r.start_restore(seq, 0, busy=False)
    seen = given_back(r) if taken else Counter()
    assert seen["ready:miss"] == 0 and sum(seen.values()) == int(taken)
    assert r.num_loading == 0 and r.hit_tokens_by_tier == Counter()
    assert seq.offload_checked


def test_forgetting_a_prefetched_sequence_lets_go_of_it(side) -> None:
    side.store(3)
    seq = sequence("gone", 3)
    r = side.restores
    r.prefetch(seq, busy=True)
    r.forget(seq)
    assert r.num_loading == 0
    assert r.poll() == RestoreOutcome([], [])
    assert side.holds_no_lease()


def test_an_aborted_restore_never_comes_back(side) -> None:
    side.store(4)
    seq = sequence("aborted", 4)
    r = side.restores
    if r.start_restore(seq, 0, busy=False):
        r.abort(seq)
        seen = given_back(r)
        assert sum(seen.values()) == 0, seen
    assert r.num_loading == 0
    assert side.holds_no_lease()


def test_answered_lookups_are_those_sent_on_arrival_and_answered(side) -> None:
    """While the device runs a step the scheduler asks which waiting sequences' arrival
    lookups are answered: never one without such a lookup, and it waits only while told to."""
    side.store(5)
    asked, unasked = sequence("asked", 5), sequence("unasked", 5)
    r = side.restores
    r.prefetch(asked, busy=True)
    answered = r.answered_lookups([asked, unasked], lambda: True, POLL_S)
    assert answered == ([asked] if side.has_store else [])
    started = time.monotonic()
    assert r.answered_lookups([unasked], lambda: True, POLL_S) == []  # nothing to wait for
    assert time.monotonic() - started < 1.0
    if r.start_restore(asked, 0, busy=True):
        assert given_back(r) == Counter({"ready:asked": 1})
    assert side.holds_no_lease()
