"""A likely hit restored ahead (``offload/restore.py`` ``prefetch(may_restore=True)``, the core's
``look_up_and_load``): its blocks are reserved on arrival and the daemon loads the hit in the
lookup's own round trip. What lands is the stored bytes; a miss, an abort, a hung store each end
it with the blocks given back (or quarantined until the daemon answers) and no lease left. Real
daemon, kvengine's bridge over its block ledger."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from daemon_helpers import wait_until
from support.arena import ShmArena
from test_restore_bridge_contract import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    CHAIN,
    NUM_BLOCKS,
    sequence,
    store_chain,
)

from engine.block_manager import BlockManager
from kvstore import Client
from offload.engine_store import EngineStore, OffloadPolicy
from offload.restore_policy import RestorePolicy
from offload.store_client import StoreClient

pytestmark = pytest.mark.timeout(60)


class Side:
    """kvengine's bridge to a daemon holding chain 1, its ledger and its arena."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES)
        self.ledger = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        client = StoreClient(daemon.socket_path, self.arena.layout, "restore-ahead", 3.0, 0.5)
        assert client.wait_available(5.0)
        self.store = EngineStore(client, self.ledger, BLOCK_BYTES, OffloadPolicy.WRITE_THROUGH,
                                 RestorePolicy({"dram": 1e9}, 1e3), always_restore=True)
        self.restores = self.store.restores
        self.counters = self.store.counters

    def likely(self, seq) -> None:
        """This engine saved ``seq``'s blocks once (so a hit is likely)."""
        self.store.saved_keys.add(seq.block_hashes[:CHAIN])

    def poll_until_over(self, seq):
        """Poll until ``seq``'s restore ended; (ready, requeued)."""
        seen: list = []

        def over() -> bool:
            outcome = self.restores.poll()
            seen.extend([(s, "ready") for s in outcome.ready]
                        + [(s, "requeue") for s in outcome.requeue])
            return seq.request_id not in self.restores.restores
        assert wait_until(over, timeout_s=10.0)
        return ([s for s, how in seen if how == "ready"],
                [s for s, how in seen if how == "requeue"])

    def num_leases(self) -> int:
        with Client(self.daemon.socket_path) as c:
            stats = c.stats()
            return stats["daemon"]["leases_active"] + stats["leases"]

    def close(self) -> None:
        self.store.close()
        self.arena.close()


@pytest.fixture
def side(make_daemon):
    # without the key filter: a likely hit the daemon lacks must still be asked for here
    daemon = make_daemon("--key-filter", "off", dram="16MiB")
    store_chain(daemon.socket_path, 1)
    made = Side(daemon)
    yield made
    made.close()


def _stored_block(seed: int, i: int) -> bytes:
    rows = np.random.default_rng(seed).integers(0, 256, (CHAIN, BLOCK_BYTES), dtype=np.uint8)
    return rows[i].tobytes()


def test_a_likely_hit_lands_from_one_round_trip(side: Side) -> None:
    seq = sequence("ahead", 1)
    side.likely(seq)
    assert side.restores.prefetch(seq, busy=False, may_restore=True)
    assert side.restores.num_loading == 1 and seq.request_id not in side.restores.prefetched
    ready, requeued = side.poll_until_over(seq)
    assert ready == [seq] and requeued == []
    assert seq.num_computed_tokens == CHAIN * BLOCK_SIZE
    for i, block in enumerate(seq.block_ids[:CHAIN]):
        assert bytes(side.arena.block(block)) == _stored_block(1, i), f"block {i} differs"
    c = side.counters
    assert c["restores_ahead"] == c["restores_landed_ahead"] == c["restores_landed"] == 1
    assert c["loads"] == 0  # no load of its own: it rode on the lookup
    assert c["restore_ms_lookup_load"] > 0 and "restore_ms_reply_to_load" not in c
    assert seq.restored_tokens_by_tier == {"dram": CHAIN * BLOCK_SIZE}
    sent, landed, ready = seq.restore_times  # its stamps, in order
    assert sent <= landed <= ready <= time.monotonic()
    assert side.num_leases() == 0


def test_without_a_likely_hit_or_leave_to_restore_only_the_lookup_goes(side: Side) -> None:
    unlikely = sequence("unlikely", 1)
    assert not side.restores.prefetch(unlikely, busy=False, may_restore=True)
    assert unlikely.request_id in side.restores.prefetched
    not_now = sequence("not-now", 1)
    side.likely(not_now)
    assert not side.restores.prefetch(not_now, busy=False, may_restore=False)
    assert not_now.request_id in side.restores.prefetched
    assert side.counters["restores_ahead"] == 0
    assert side.ledger.num_free_blocks == NUM_BLOCKS  # nothing reserved for either


def test_a_likely_hit_that_misses_gives_its_blocks_back(side: Side) -> None:
    seq = sequence("gone", 2)  # chain 2 was never stored
    side.likely(seq)
    assert side.restores.prefetch(seq, busy=False, may_restore=True)
    assert side.ledger.num_free_blocks < NUM_BLOCKS  # reserved on arrival
    ready, requeued = side.poll_until_over(seq)
    assert ready == [] and requeued == [seq]
    assert side.counters["restores_miss"] == 1
    assert side.ledger.num_free_blocks == NUM_BLOCKS and seq.num_computed_tokens == 0
    assert side.num_leases() == 0


def test_an_abort_in_flight_frees_the_blocks_when_the_daemon_answers(side: Side) -> None:
    seq = sequence("aborted", 1)
    side.likely(seq)
    side.daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert side.restores.prefetch(seq, busy=False, may_restore=True)
        assert side.restores.abort(seq)  # in flight: the blocks wait for the daemon
        assert side.ledger.num_free_blocks < NUM_BLOCKS
    finally:
        side.daemon.proc.send_signal(signal.SIGCONT)
    ready, requeued = side.poll_until_over(seq)
    assert ready == [] and requeued == []
    assert side.counters["restores_aborted"] == 1
    assert wait_until(lambda: side.ledger.num_free_blocks == NUM_BLOCKS)
    assert side.num_leases() == 0


def test_a_hung_store_requeues_it_and_quarantines_the_blocks_until_it_answers(
        side: Side) -> None:
    seq = sequence("hung", 1)
    side.likely(seq)
    side.daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert side.restores.prefetch(seq, busy=False, may_restore=True)
        ready, requeued = side.poll_until_over(seq)  # given up once the probe is overdue
        assert ready == [] and requeued == [seq]
        assert side.counters["restores_store_hung"] == 1
        # The daemon may still write them: kept out of use, not handed to anyone.
        assert side.ledger.num_free_blocks == NUM_BLOCKS - CHAIN
    finally:
        side.daemon.proc.send_signal(signal.SIGCONT)

    def released() -> bool:  # asking for the connection each time, as the engine's steps do
        side.store.client.keep_connected()
        side.restores.poll()
        return side.ledger.num_free_blocks == NUM_BLOCKS and side.num_leases() == 0
    assert wait_until(released, timeout_s=10.0)


def test_a_lost_connection_quarantines_the_blocks_until_the_link_registers_again(
        side: Side) -> None:
    """The lookup_load went out, then its connection was lost before the reply (the daemon
    lives on and may still be loading): the blocks stay out of use until a newer registration
    was accepted, which the daemon allows only once the old one's copies are done. They used to
    go back at once, ended as a failed lookup."""
    seq = sequence("lost", 1)
    side.likely(seq)
    epoch = side.store.client.registration_epoch
    side.daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert side.restores.prefetch(seq, busy=False, may_restore=True)
        lookup = side.restores.restores[seq.request_id].lookup
        assert wait_until(lambda: lookup.sent_epoch is not None, 2.0)  # it went out
        side.store.client._thread.want_drop()
        ready, requeued = side.poll_until_over(seq)
        assert ready == [] and requeued == [seq]
        assert side.counters["restores_load_lost"] == 1
        assert side.ledger.num_free_blocks == NUM_BLOCKS - CHAIN  # quarantined
    finally:
        side.daemon.proc.send_signal(signal.SIGCONT)

    def released() -> bool:
        side.restores.poll()
        return side.ledger.num_free_blocks == NUM_BLOCKS
    assert wait_until(released, timeout_s=15.0)
    assert side.store.client.registration_epoch > epoch
    assert side.counters["blocks_quarantine_released_after_reconnect"] == CHAIN


def test_a_likely_hit_on_ssd_comes_back_leased_and_is_loaded_the_two_step_way(
        make_daemon, tmp_path) -> None:
    ssd = dict(ssd_dir=tmp_path / "ssd", ssd_size="16MiB", http=False)
    first = make_daemon(dram="4MiB", **ssd)
    store_chain(first.socket_path, 3)
    assert first.stop() == 0  # the chain is on SSD only now
    side = Side(make_daemon(dram="4MiB", **ssd))
    try:
        seq = sequence("on-ssd", 3)
        side.likely(seq)
        assert side.restores.prefetch(seq, busy=False, may_restore=True)
        ready, requeued = side.poll_until_over(seq)
        assert ready == [seq] and requeued == []
        for i, block in enumerate(seq.block_ids[:CHAIN]):
            assert bytes(side.arena.block(block)) == _stored_block(3, i), f"block {i} differs"
        c = side.counters
        assert c["restores_ahead"] == 1 and c["loads"] == 1  # the daemon did not load it
        assert c["restores_landed_ahead"] == 0 and seq.restored_tokens_by_tier == {
            "ssd": CHAIN * BLOCK_SIZE}
        assert side.num_leases() == 0
    finally:
        side.close()


def test_a_daemon_older_than_lookup_load_is_asked_the_two_step_way(make_daemon) -> None:
    daemon = make_daemon(dram="16MiB", protocol="1.3")  # says 1.3 in its hello
    store_chain(daemon.socket_path, 1)
    side = Side(daemon)
    try:
        assert not side.store.client.daemon_knows("lookup_load")
        assert side.store.client.daemon_knows("lookup")
        seq = sequence("older", 1)
        side.likely(seq)
        assert not side.restores.prefetch(seq, busy=False, may_restore=True)  # a plain lookup
        assert seq.request_id in side.restores.prefetched
        assert side.counters["restores_ahead"] == 0 and side.counters["lookup_loads"] == 0
        assert side.restores.start_restore(seq, 0, False)
        ready, requeued = side.poll_until_over(seq)
        assert ready == [seq] and requeued == []
        assert side.counters["loads"] == 1 and side.counters["restores_landed"] == 1
        for i, block in enumerate(seq.block_ids[:CHAIN]):
            assert bytes(side.arena.block(block)) == _stored_block(1, i), f"block {i} differs"
    finally:
        side.close()
