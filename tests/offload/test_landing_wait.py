"""A load about to land is waited for at the start of a step (``offload/restore.py``): its
sequence runs in the step being scheduled instead of the next one. Bounded by a share of the
previous step's time; a load expected to take longer is not waited for. Real daemon."""

from __future__ import annotations

import time

import pytest
from support.arena import ShmArena
from test_restore_bridge_contract import BLOCK_BYTES, BLOCK_SIZE, NUM_BLOCKS, sequence, store_chain

import offload.restore as restore
from engine.block_manager import BlockManager
from offload.engine_store import EngineStore, OffloadPolicy
from offload.restore_policy import RestorePolicy
from offload.store_client import StoreClient

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def bridge(make_daemon):
    """A daemon holding chain 1 and a factory of kvengine's bridge to it (the policy's DRAM
    bandwidth given); the landing wait's cap raised to a loaded CI host's round trip."""
    daemon = make_daemon(dram="16MiB")
    store_chain(daemon.socket_path, 1)
    arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES)
    made: list[EngineStore] = []

    def make(dram_bytes_per_s: float) -> EngineStore:
        client = StoreClient(daemon.socket_path, arena.layout, "landing-wait", 3.0, 0.5)
        assert client.wait_available(5.0)
        made.append(EngineStore(client, BlockManager(NUM_BLOCKS, BLOCK_SIZE), BLOCK_BYTES,
                                OffloadPolicy.WRITE_THROUGH,
                                RestorePolicy({"dram": dram_bytes_per_s}, 1e3),
                                always_restore=True, max_landing_wait_s=5.0))
        return made[-1]

    yield make
    for b in made:
        b.close()
    arena.close()


def _start(store: EngineStore, seed: int):
    """A restore of stored chain ``seed`` whose load is on its way when this returns."""
    seq = sequence(f"s{seed}", seed)
    r = store.restores
    r.prefetch(seq, busy=True)
    assert r.prefetched[seq.request_id].lookup.wait(5.0)  # the reply is in: the load goes now
    assert r.start_restore(seq, 0, busy=True)
    return seq


@pytest.mark.parametrize("step_s", [0.4, 2.0])
def test_a_load_about_to_land_runs_in_this_step(bridge, step_s) -> None:
    store = bridge(1e9)
    store.restores.policy.observe_step(0, step_s)  # budget: half of it
    seq = _start(store, 1)
    outcome = store.restores.poll()  # the first poll after the load went out
    assert [s.request_id for s in outcome.ready] == [seq.request_id]
    counters = store.counters
    assert counters["loads_awaited"] == counters["loads_awaited_landed"] == 1
    # where the landed restore's time went, stage by stage (ms, summed over restores)
    stages = {k: v for k, v in counters.items() if k.startswith("restore_ms_")}
    assert set(stages) == {"restore_ms_lookup", "restore_ms_reply_to_load", "restore_ms_load",
                           "restore_ms_landed_to_ready"}
    assert all(v >= 0 for v in stages.values()) and stages["restore_ms_load"] > 0


def test_a_load_expected_past_the_budget_is_not_waited_for(bridge) -> None:
    store = bridge(1e3)  # 24 KB: 24 s expected
    store.restores.policy.observe_step(0, 2.0)  # a 1 s budget
    _start(store, 1)
    started = time.monotonic()
    store.restores.poll()
    assert time.monotonic() - started < 0.5
    assert store.counters["loads_awaited"] == 0


def test_the_budget_is_a_share_of_the_last_step_within_bounds() -> None:
    assert restore.landing_wait_budget_s(0.0) == restore.LANDING_WAIT_MIN_S
    assert restore.landing_wait_budget_s(0.008) == pytest.approx(0.004)
    assert restore.landing_wait_budget_s(1.0) == restore.MAX_LANDING_WAIT_S
    assert restore.landing_wait_budget_s(1.0, cap_s=5.0) == pytest.approx(0.5)
