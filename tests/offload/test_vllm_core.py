"""The vLLM connector's core against a real daemon, without vLLM: torch tensors shaped like
vLLM's CPU backend, saved by one "instance" and loaded by another through the staging path."""

from __future__ import annotations

import itertools
import signal
import threading
import time
from dataclasses import dataclass

import pytest
from daemon_helpers import start_daemon, wait_until

from kvstore import StoreState
from kvstore.keys import shard_namespace
from offload.external.block_keys import KeyMaker
from offload.external.kv_tensors import make_mover
from offload.external.worker_side import WorkerSide
from offload.store_client import StoreClient
from offload.vllm.model_identity import vllm_identity
from offload.vllm.scheduler_side import ScheduledRequest, SchedulerSide

torch = pytest.importorskip("torch")

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 24, 16, 2, 32, 2
MODEL = vllm_identity("Qwen3ForCausalLM", LAYERS, HEADS, HEAD_DIM, "bfloat16", BLOCK_SIZE,
                      "test-weights", "cpu:LBHNC")
LOOKUP_TIMEOUT_S, LOAD_TIMEOUT_S, RETRY_S = 0.3, 1.5, 0.5


@dataclass
class Instance:
    """One vLLM-like instance: its KV tensors (CPU layout, one storage for all layers as vLLM
    allocates them), its scheduler side and its worker side."""

    layers: list
    scheduler: SchedulerSide
    worker: WorkerSide

    def __post_init__(self) -> None:
        _OPEN.append(self)

    def close(self) -> None:
        """Ends both sides' store links (each runs a thread that would outlive the test and
        keep retrying a daemon that is gone, logging into later tests)."""
        self.worker.close()
        self.scheduler.client.close()

    def block(self, block_id: int) -> bytes:
        dim = 1 if self.layers[0].shape[0] == 2 else 0  # flash layout: [2, blocks, ...]
        return b"".join(t.select(dim, block_id).contiguous().view(torch.uint8).numpy().tobytes()
                        for t in self.layers)

    def save(self, rid: str, tokens: list[int], block_ids: list[int], salt=None) -> None:
        self.scheduler.match(rid, tokens, 0, salt, None)  # as vLLM: asked first, then tracked
        self.scheduler.after_alloc(rid, block_ids, 0)
        plan = self.scheduler.plan_step([ScheduledRequest(rid, 0, len(tokens), None)])
        self.worker.save(plan)
        self.worker.drain(5.0)

    def load(self, rid: str, tokens: list[int], block_ids: list[int], salt=None,
             max_wait_s: float = 10.0) -> tuple[int, set[int], float]:
        """(tokens the scheduler matched, failed block ids, seconds until finished)."""
        start = time.monotonic()
        n = self.scheduler.match(rid, tokens, 0, salt, None)
        self.scheduler.after_alloc(rid, block_ids, n)
        plan = self.scheduler.plan_step([])
        if not plan.loads:
            return n, set(), time.monotonic() - start
        self.worker.start(plan)
        failed: set[int] = set()
        while time.monotonic() - start < max_wait_s:
            done, bad = self.worker.poll()
            failed |= bad
            if rid in done:
                self.scheduler.loads_finished(done)
                return n, failed, time.monotonic() - start
            time.sleep(0.002)
        raise AssertionError("load never finished")


_INSTANCES = itertools.count()
_OPEN: list[Instance] = []


@pytest.fixture(autouse=True)
def _close_instances():
    """Every instance a test made is closed after it (test_vllm_families_core uses it too)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def make_instance(socket_path, seed: int | None, load_blocks: int = 16,
                  flash: bool = False, rank: int = 0, num_ranks: int = 1, loads: bool = True,
                  saves: bool = True) -> Instance:
    """``flash``: each layer ``[2, num_blocks, block_size, heads, head_dim]`` (two regions
    per layer) instead of the CPU backend's ``[num_blocks, heads, block_size, 2 * head_dim]``.
    ``rank`` of ``num_ranks``: one tensor-parallel rank's worker side (and a scheduler side
    as vLLM's, which looks up for all ranks). ``loads``/``saves``: vLLM's ``kv_role``."""
    raw = torch.zeros(LAYERS * NUM_BLOCKS * HEADS * BLOCK_SIZE * 2 * HEAD_DIM,
                      dtype=torch.bfloat16)
    if seed is not None:
        raw.copy_(torch.randn(raw.shape, generator=torch.Generator().manual_seed(seed)))
    if flash:
        layers = list(raw.view(LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM).unbind(0))
    else:
        layers = list(raw.view(LAYERS, NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM).unbind(0))
    mover = make_mover([f"l{i}" for i in range(LAYERS)], layers, NUM_BLOCKS, load_blocks + 16,
                       {"engine": "vllm-test"})
    # one engine id per instance, as each vLLM process has its own (the daemon refuses a live
    # engine's id to another connection)
    worker = WorkerSide(socket_path, mover, f"vllm-test-{next(_INSTANCES)}-tp{rank}",
                        LOAD_TIMEOUT_S, LOAD_TIMEOUT_S,
                        register_timeout_s=1.0, retry_interval_s=RETRY_S, shard=rank,
                        num_shards=num_ranks)
    assert worker.connect()
    client = StoreClient(socket_path, None, "vllm-test-scheduler", LOAD_TIMEOUT_S, RETRY_S)
    scheduler = SchedulerSide(KeyMaker(MODEL), client, load_blocks, LOOKUP_TIMEOUT_S, num_ranks,
                              loads=loads, saves=saves)
    return Instance(layers, scheduler, worker)


def prompt(seed: int, num_blocks: int = 10) -> list[int]:
    return [(seed * 1009 + i * 31) % 5000 for i in range(num_blocks * BLOCK_SIZE + 3)]


@pytest.fixture
def daemon(make_daemon):
    return make_daemon(dram="32MiB")


@pytest.mark.parametrize("flash", [False, True], ids=["cpu-layout", "flash-layout"])
def test_blocks_saved_by_one_instance_load_byte_exact_into_another(daemon, flash) -> None:
    a = make_instance(daemon.socket_path, 1, flash=flash)
    b = make_instance(daemon.socket_path, None, flash=flash)
    tokens, a_ids, b_ids = prompt(1), list(range(3, 14)), list(range(12, 23))
    a.save("r", tokens, a_ids)
    assert a.worker.counters["blocks_saved"] == 10
    n, failed, _ = b.load("r", tokens, b_ids)
    assert n == 10 * BLOCK_SIZE and not failed
    # vLLM asks for the hit's tiers after update_state_after_alloc: they must still be there.
    assert b.scheduler.hit_tiers("r") == ["dram"] * 10
    for i in range(10):
        assert b.block(b_ids[i]) == a.block(a_ids[i])
    assert b.block(b_ids[10]) == bytes(len(a.block(0)))  # the partial block was not touched
    assert b.worker.counters["blocks_loaded"] == 10
    # One round trip: the worker's lookup was loaded at once into slots lent ahead.
    assert b.worker.counters["loads_ahead"] == 1
    assert b.worker.client.counters["lookup_loads"] == 1


def test_a_producer_only_saves_and_a_consumer_only_loads(daemon) -> None:
    producer = make_instance(daemon.socket_path, 50, loads=False)  # kv_role "kv_producer"
    consumer = make_instance(daemon.socket_path, None, saves=False)  # "kv_consumer"
    tokens, ids = prompt(50), list(range(11))
    producer.save("r", tokens, ids)
    assert producer.worker.counters["blocks_saved"] == 10
    n, failed, _ = consumer.load("r", tokens, ids)
    assert n == 10 * BLOCK_SIZE and not failed
    assert all(consumer.block(i) == producer.block(i) for i in ids[:10])
    consumer.save("r2", prompt(51), ids)  # computed by the consumer: nothing goes to the store
    assert consumer.worker.counters["blocks_saved"] == 0
    assert consumer.scheduler.counters["blocks_save_planned"] == 0
    # The producer takes no hit, not even for blocks the store holds, and never asks.
    assert producer.scheduler.match("r3", tokens, 0, None, None) == 0
    assert producer.scheduler.counters["lookups"] == 0
    with pytest.raises(ValueError, match="neither loads nor saves"):
        SchedulerSide(KeyMaker(MODEL), producer.scheduler.client, 16, 1.0, loads=False,
                      saves=False)


def test_bad_tensor_parallel_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 of 2"):
        WorkerSide(None, None, "bad-rank", 1.0, 1.0, shard=2, num_shards=2)
    with pytest.raises(ValueError, match="num_shards must be at least 1"):
        SchedulerSide(KeyMaker(MODEL), None, 16, 1.0, num_shards=0)


def test_cache_salts_never_share(daemon) -> None:
    a, b = make_instance(daemon.socket_path, 2), make_instance(daemon.socket_path, None)
    tokens = prompt(2)
    a.save("r", tokens, list(range(11)), salt="alice")
    assert b.load("r1", tokens, list(range(11)), salt="bob")[0] == 0
    assert b.load("r2", tokens, list(range(11)))[0] == 0
    assert b.load("r3", tokens, list(range(11)), salt="alice")[0] == 10 * BLOCK_SIZE


def _load_on_ranks(scheduler_of: Instance, ranks: list[Instance], rid: str, tokens: list[int],
                   block_ids: list[int], before_load=None) -> tuple[int, list[set[int]]]:
    """One scheduler plans a load, every rank's worker runs it (as vLLM's workers do): the
    scheduler's match and each rank's failed block ids. ``before_load`` runs between the
    scheduler's lookup and the workers' loads."""
    n = scheduler_of.scheduler.match(rid, tokens, 0, None, None)
    if before_load is not None:
        before_load()
    scheduler_of.scheduler.after_alloc(rid, block_ids, n)
    plan = scheduler_of.scheduler.plan_step([])
    failed: list[set[int]] = [set() for _ in ranks]
    for r in ranks:
        r.worker.start(plan)
    pending = set(range(len(ranks)))
    deadline = time.monotonic() + 10.0
    while pending and time.monotonic() < deadline:
        for i in list(pending):
            done, bad = ranks[i].worker.poll()
            failed[i] |= bad
            if rid in done:
                pending.discard(i)
        time.sleep(0.002)
    assert not pending, "a rank's load never finished"
    return n, failed


def test_tensor_parallel_ranks_each_save_and_load_their_own_shard(daemon) -> None:
    a = [make_instance(daemon.socket_path, 40 + r, rank=r, num_ranks=2) for r in range(2)]
    b = [make_instance(daemon.socket_path, None, rank=r, num_ranks=2) for r in range(2)]
    tokens, a_ids, b_ids = prompt(40), list(range(11)), list(range(11, 22))
    for r in a:
        r.save("r", tokens, a_ids)
        assert r.worker.counters["blocks_saved"] == 10
    assert a[0].block(0) != a[1].block(0)  # two shards, two contents, one set of keys
    n, failed = _load_on_ranks(b[0], b, "r", tokens, b_ids)
    assert n == 10 * BLOCK_SIZE and failed == [set(), set()]
    for rank in range(2):
        assert all(b[rank].block(b_ids[i]) == a[rank].block(a_ids[i]) for i in range(10))
    # A one-rank engine shares nothing with a two-rank one (its blocks hold all heads).
    single = make_instance(daemon.socket_path, None)
    assert single.load("r", tokens, b_ids)[0] == 0


def test_the_hit_is_the_shortest_shard_and_a_shard_lost_before_its_load_is_recomputed(
        daemon) -> None:
    a = [make_instance(daemon.socket_path, 41 + r, rank=r, num_ranks=2) for r in range(2)]
    b = [make_instance(daemon.socket_path, None, rank=r, num_ranks=2) for r in range(2)]
    tokens, ids = prompt(41), list(range(11))
    a[0].save("r", tokens, ids)
    a[1].save("r", tokens[:8 * BLOCK_SIZE + 1], ids[:9])  # rank 1 stored only 8 blocks
    keys = KeyMaker(MODEL).keys(tokens)

    def evict_some_of_rank_1() -> None:  # between the scheduler's lookup and the loads
        with daemon.client() as c:
            assert c.remove(shard_namespace(keys.namespace, 1, 2), keys.hashes[5:8]) == 3

    n, failed = _load_on_ranks(b[0], b, "r", tokens, ids, evict_some_of_rank_1)
    assert n == 8 * BLOCK_SIZE  # what every shard had at lookup time
    assert failed == [set(), set(ids[5:8])]  # vLLM recomputes them for every rank
    assert b[1].worker.counters["blocks_load_failed"] == 3
    assert all(b[0].block(i) == a[0].block(i) for i in ids[:8])


def test_failures_reported_in_different_steps_all_count(daemon) -> None:
    """Tensor-parallel ranks report failed blocks when each finds them: the earliest wins."""
    a, b = make_instance(daemon.socket_path, 42), make_instance(daemon.socket_path, None)
    tokens, ids = prompt(42, num_blocks=6), list(range(7))
    a.save("r", tokens, ids)
    b.scheduler.after_alloc("r", ids, b.scheduler.match("r", tokens, 0, None, None))
    assert [t.block_ids for t in b.scheduler.plan_step([]).loads] == [ids[:6]]
    b.scheduler.loads_failed({4, 5})  # one rank, one step
    b.scheduler.loads_failed({2, 3, 4, 5})  # another rank, the next step
    b.scheduler.loads_failed({3})  # nothing earlier: no change
    b.scheduler.loads_finished({"r"})
    plan = b.scheduler.plan_step([ScheduledRequest("r", 2 * BLOCK_SIZE, 4 * BLOCK_SIZE + 3,
                                                   None)])
    assert [t.block_ids for t in plan.saves] == [[2, 3, 4, 5]]
    assert b.scheduler.counters["blocks_load_failed"] == 4


def test_a_short_hit_reports_the_missing_blocks_for_recompute(daemon) -> None:
    a, b = make_instance(daemon.socket_path, 3), make_instance(daemon.socket_path, None)
    tokens, ids = prompt(3), list(range(11))
    a.save("r", tokens, ids)
    n = b.scheduler.match("r", tokens, 0, None, None)
    assert n == 10 * BLOCK_SIZE
    keys = KeyMaker(MODEL).keys(tokens)
    with daemon.client() as c:  # evicted between the scheduler's lookup and the worker's load
        assert c.remove(keys.namespace, keys.hashes[6:]) == 4
    b.scheduler.after_alloc("r", ids, n)
    b.worker.start(b.scheduler.plan_step([]))
    failed: set[int] = set()
    for _ in range(2000):
        done, bad = b.worker.poll()
        failed |= bad
        if done:
            break
        time.sleep(0.002)
    assert failed == set(ids[6:10])
    assert all(b.block(i) == a.block(i) for i in ids[:6])


def test_blocks_that_failed_to_load_are_saved_again_after_recompute(daemon) -> None:
    a, b = make_instance(daemon.socket_path, 9), make_instance(daemon.socket_path, None)
    tokens, ids = prompt(9, num_blocks=4), list(range(5))
    a.save("r", tokens, ids)
    n = b.scheduler.match("r", tokens, 0, None, None)
    b.scheduler.after_alloc("r", ids, n)
    assert [t.block_ids for t in b.scheduler.plan_step([]).loads] == [[0, 1, 2, 3]]
    b.scheduler.loads_failed({2, 3})  # as vLLM reports them: it recomputes blocks 2 and 3
    b.scheduler.loads_finished({"r"})
    plan = b.scheduler.plan_step([ScheduledRequest("r", 2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 3,
                                                   None)])
    assert [t.block_ids for t in plan.saves] == [[2, 3]]


def test_a_preempted_request_restores_what_it_saved_into_its_new_blocks(daemon) -> None:
    """vLLM preempts by freeing a request's blocks; resumed, it is matched again and scheduled
    with a whole new block table: the blocks it saved come back from the store into the new
    table, and only the rest is computed and saved."""
    b = make_instance(daemon.socket_path, 43)
    tokens = prompt(43)
    first_ids, new_ids = list(range(11)), list(range(11, 22))
    sched = b.scheduler
    assert sched.match("r", tokens, 0, None, None) == 0
    sched.after_alloc("r", first_ids, 0)
    plan = sched.plan_step([ScheduledRequest("r", 0, 4 * BLOCK_SIZE, None)])  # first chunk
    assert [t.block_ids for t in plan.saves] == [first_ids[:4]]
    b.worker.save(plan)
    b.worker.drain(5.0)
    saved = [b.block(i) for i in first_ids[:4]]
    # Preempted: vLLM frees the blocks (another request overwrites them), then resumes it.
    for i in first_ids:
        b.layers[0].select(0, i).zero_()
    assert sched.match("r", tokens, 0, None, None) == 4 * BLOCK_SIZE
    sched.after_alloc("r", new_ids, 4 * BLOCK_SIZE)
    plan = sched.plan_step([ScheduledRequest("r", 4 * BLOCK_SIZE, 6 * BLOCK_SIZE + 3, new_ids,
                                             replaces_blocks=True)])
    assert [t.block_ids for t in plan.loads] == [new_ids[:4]]
    assert [t.block_ids for t in plan.saves] == [new_ids[4:10]]
    b.worker.start(plan)
    deadline = time.monotonic() + 5.0
    while "r" not in b.worker.poll()[0]:
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.002)
    assert [b.block(i) for i in new_ids[:4]] == saved
    # Decoding fills its last block: saved from the new table (which replaced the old one,
    # never appended to it), then the next block vLLM adds.
    tokens.extend(range(BLOCK_SIZE - 3))  # vLLM's token list grows as tokens are sampled
    plan = sched.plan_step([ScheduledRequest("r", 10 * BLOCK_SIZE + 3, BLOCK_SIZE - 3, None)])
    assert [t.block_ids for t in plan.saves] == [[new_ids[10]]]
    tokens.extend(range(BLOCK_SIZE))
    plan = sched.plan_step([ScheduledRequest("r", 11 * BLOCK_SIZE, BLOCK_SIZE, [99])])
    assert [t.block_ids for t in plan.saves] == [[99]]


def test_a_hit_becomes_one_load_whose_budget_comes_back(daemon) -> None:
    """A hit is loaded once (vLLM reserving blocks again plans nothing more); its blocks hold
    the load budget until the workers report the load finished, or the request finishes."""
    a = make_instance(daemon.socket_path, 44)
    b = make_instance(daemon.socket_path, None, load_blocks=10)
    tokens, ids = prompt(44), list(range(11))
    a.save("r", tokens, ids)
    sched = b.scheduler
    n = sched.match("r", tokens, 0, None, None)
    assert n == 10 * BLOCK_SIZE
    sched.after_alloc("r", ids, n)
    sched.after_alloc("r", ids, n)
    assert [t.block_ids for t in sched.plan_step([]).loads] == [ids[:10]]
    assert sched.match("r2", tokens, 0, None, None) == 0  # r's load holds the whole budget
    assert sched.counters["lookups_skipped_budget"] == 1
    sched.loads_finished({"r"})
    assert sched.match("r2", tokens, 0, None, None) == n
    sched.after_alloc("r2", ids, n)
    assert [t.request_id for t in sched.plan_step([]).loads] == ["r2"]
    assert sched.finished("r2") is False  # no saves planned; its load's budget is free again
    assert sched.match("r3", tokens, 0, None, None) == n
    sched.match("r3", tokens, 0, None, None)  # asked again before vLLM reserved its blocks
    sched.after_alloc("r3", ids, 0)  # vLLM took none of the hit: nothing to load
    assert sched.plan_step([]).loads == []


def test_load_budget_caps_a_hit(daemon) -> None:
    a = make_instance(daemon.socket_path, 4)
    b = make_instance(daemon.socket_path, None, load_blocks=4)
    tokens = prompt(4)
    a.save("r", tokens, list(range(11)))
    n, failed, _ = b.load("r", tokens, list(range(11)))
    assert n == 4 * BLOCK_SIZE and not failed
    assert b.block(3) == a.block(3) and b.block(4) != a.block(4)


def test_a_prompt_no_tier_holds_is_a_miss_without_a_lookup(daemon) -> None:
    """The daemon's key filter lacks the prompt's first block: vLLM's scheduler hears 0 at
    once, with no round trip to wait for; once saved, the same prompt is looked up and loads."""
    a = make_instance(daemon.socket_path, 5)
    assert a.scheduler.client.wait_available(5.0)  # the hello named the filter
    tokens, ids = prompt(7), list(range(11))
    assert a.scheduler.match("new", tokens, 0, None, None) == 0
    assert a.scheduler.counters["lookups_skipped_absent"] == 1
    assert a.scheduler.counters["lookups"] == 0
    a.save("saved", tokens, ids)
    b = make_instance(daemon.socket_path, None)
    assert b.scheduler.client.wait_available(5.0)
    n, failed, _ = b.load("again", tokens, ids)
    assert n == 10 * BLOCK_SIZE and not failed
    assert b.scheduler.counters["lookups"] == 1 and b.block(0) == a.block(0)


def test_a_stopped_daemon_costs_a_bounded_wait_then_the_store_is_used_again(daemon) -> None:
    a, b = make_instance(daemon.socket_path, 5), make_instance(daemon.socket_path, None)
    tokens, ids = prompt(5), list(range(11))
    a.save("r", tokens, ids)
    n = b.scheduler.match("r", tokens, 0, None, None)
    b.scheduler.after_alloc("r", ids, n)
    plan = b.scheduler.plan_step([])
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert b.scheduler.match("r2", prompt(5), 0, None, None) == 0
        assert time.monotonic() - start < LOOKUP_TIMEOUT_S + 0.5
        # The link's health probe finds the daemon hung within a second (kvengine's link):
        # from then on a lookup is a miss at once.
        assert wait_until(lambda: b.scheduler.client.live_state is StoreState.HUNG, 2.0)
        start = time.monotonic()
        assert b.scheduler.match("r3", prompt(5), 0, None, None) == 0
        assert time.monotonic() - start < 0.1
        b.worker.start(plan)  # its load was planned before the stop
        failed: set[int] = set()
        while time.monotonic() - start < LOAD_TIMEOUT_S + 2.0:
            done, bad = b.worker.poll()
            failed |= bad
            if done:
                break
            time.sleep(0.005)
        assert done == {"r"} and failed == set(ids[:10])
        a.save("r4", prompt(6), ids)  # write-through while stopped: never blocks the step
        assert a.worker.counters["blocks_saved"] == 10
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    time.sleep(RETRY_S + 0.1)
    c = make_instance(daemon.socket_path, None)
    n, failed, _ = c.load("r5", tokens, ids)
    assert n == 10 * BLOCK_SIZE and not failed
    assert c.block(0) == a.block(0)


def test_a_killed_daemon_means_recompute_until_a_new_one_is_up(daemon, tmp_path) -> None:
    a, b = make_instance(daemon.socket_path, 7), make_instance(daemon.socket_path, None)
    tokens, ids = prompt(7), list(range(11))
    a.save("r", tokens, ids)
    daemon.proc.kill()
    daemon.proc.wait(10)
    start = time.monotonic()
    assert b.load("r1", tokens, ids)[0] == 0
    a.save("r2", prompt(8), ids)
    assert time.monotonic() - start < 1.0
    assert a.worker.counters["blocks_saved"] == 10
    fresh = start_daemon(tmp_path, socket_path=daemon.socket_path, http=False)
    try:
        time.sleep(RETRY_S + 0.1)
        # The next step asks for a reconnect, which the link makes (with the registration of a
        # new staging buffer) on its own thread: that step's saves are skipped (counted), a
        # later step finds it registered.
        a.save("r3", tokens, ids)
        assert a.worker.counters["blocks_save_skipped_unavailable"] >= 10
        assert wait_until(a.worker.ready, 5.0)
        a.save("r3b", tokens, ids)  # the same tokens again (a skipped save is not retried)
        assert a.worker.client.counters["connects"] == 2
        assert a.worker.counters["blocks_saved"] == 20
        time.sleep(RETRY_S + 0.1)
        n, failed, _ = b.load("r4", tokens, ids)
        assert n == 10 * BLOCK_SIZE and not failed
        assert all(b.block(i) == a.block(i) for i in ids[:10])
    finally:
        fresh.stop()


def _plan_saves(instance: Instance, rid: str, tokens: list[int], ids: list[int]):
    instance.scheduler.match(rid, tokens, 0, None, None)
    instance.scheduler.after_alloc(rid, ids, 0)
    return instance.scheduler.plan_step([ScheduledRequest(rid, 0, len(tokens), None)])


def test_a_request_with_saves_keeps_its_blocks_until_they_ended(daemon) -> None:
    """Saves never hold up a step: one whose blocks are not written yet (the step's compute,
    behind an event on a GPU) waits pinned, and the finished request's blocks stay vLLM's
    until the worker reports it in finished_sending."""
    a = make_instance(daemon.socket_path, 9)
    tokens, ids = prompt(9), list(range(11))
    computed = threading.Event()
    start = time.monotonic()
    a.worker.save(_plan_saves(a, "r", tokens, ids), ready=computed.is_set)
    assert time.monotonic() - start < 0.5  # nothing waited for
    assert a.scheduler.finished("r") is True  # vLLM keeps r's blocks for now
    assert a.worker.finished_saving({"r"}) == set()
    time.sleep(0.2)
    a.worker.poll()
    assert a.worker.counters["saves"] == 0  # not sent before its blocks are written
    computed.set()
    assert wait_until(lambda: "r" in a.worker.finished_saving(()), 5.0)
    assert a.worker.counters["blocks_saved"] == 10
    assert a.worker.finished_saving(()) == set()  # reported once
    # A request that planned no save is freed at once, and never reported.
    a.scheduler.match("quiet", prompt(10), 0, None, None)
    assert a.scheduler.finished("quiet") is False
    assert a.worker.finished_saving({"quiet"}) == set()


def test_a_preempted_requests_saves_end_before_the_next_forward(daemon) -> None:
    a = make_instance(daemon.socket_path, 11)
    computed = threading.Event()
    a.worker.save(_plan_saves(a, "r", prompt(11), list(range(11))), ready=computed.is_set)
    plan = a.scheduler.plan_step([], preempted={"r", "never-saved"})
    assert plan.flush == ["r"]
    threading.Timer(0.3, computed.set).start()
    start = time.monotonic()
    a.worker.flush(plan.flush)  # vLLM may give r's blocks to another request after this
    assert time.monotonic() - start >= 0.25
    assert a.worker.counters["blocks_saved"] == 10 and a.worker.counters["save_flushes"] == 1
    assert a.worker.num_in_flight == 0



def test_a_save_without_staging_room_waits_holding_the_blocks_and_a_preempted_one_is_dropped(
        daemon) -> None:
    """The staging buffer full (loads hold it): a finished request's save waits for room
    and vLLM keeps its blocks until it went out (finished_sending); a preempted request's
    waiting save is dropped at the flush, not waited for (its blocks go to others)."""
    a = make_instance(daemon.socket_path, 12)
    buffer = a.worker.mover.buffer
    hog = buffer.take(buffer.num_free)
    a.worker.save(_plan_saves(a, "done", prompt(12), list(range(11))))
    a.worker.save(_plan_saves(a, "gone", prompt(13), list(range(11, 22))))
    assert a.scheduler.finished("done") is True
    assert a.worker.finished_saving({"done"}) == set()  # waiting for room: blocks held
    assert a.worker.counters["saves_waited_for_room"] == 2
    start = time.monotonic()
    a.worker.flush(a.scheduler.plan_step([], preempted={"gone"}).flush)
    assert time.monotonic() - start < 0.1
    assert a.worker.counters["blocks_save_dropped_preempted"] == 10
    buffer.give_back(hog)
    assert wait_until(lambda: "done" in a.worker.finished_saving(()), 5.0)
    assert a.worker.counters["blocks_saved"] == 10
    assert a.worker.counters["blocks_save_skipped_no_room"] == 0
    b = make_instance(daemon.socket_path, None)
    n, failed, _ = b.load("r", prompt(12), list(range(3, 14)))
    assert n == 10 * BLOCK_SIZE and not failed
    assert [b.block(i) for i in range(3, 13)] == [a.block(i) for i in range(10)]
