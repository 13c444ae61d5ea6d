"""--kv-offload end to end on CPU: a real daemon, real engines, greedy output must not change.

Each test compares against an engine with no cache at all: a restored prefix (from DRAM or SSD, in
a fresh engine or after a restart) must give the very same greedy tokens, and a store that is
missing, dies, or serves short loads must only ever cost recompute.
"""

from __future__ import annotations

import time

import pytest
from daemon_helpers import wait_until
from offload_helpers import (
    GREEDY,
    close_llm,
    offload_llm,
    random_prompt,
    store_through_an_engine,
)

from engine import LLM


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy tokens with prefix caching off: the ground truth every cached run must match."""
    llm = LLM(str(tiny_model_dir), device="cpu", enable_prefix_caching=False, num_kv_blocks=64)
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = llm.generate([prompt], GREEDY)[0].token_ids
        return cache[key]

    yield run
    llm.close()


def test_restore_from_dram_in_a_fresh_engine_matches_no_cache(tiny_model_dir, make_daemon,
                                                             reference) -> None:
    daemon = make_daemon(dram="64MiB")
    prompt = random_prompt(1000, 16 * 12 + 5, seed=1)
    first = offload_llm(tiny_model_dir, daemon)
    out = first.generate([prompt], GREEDY)[0]
    assert out.token_ids == reference(prompt)
    assert out.cached_tokens_by_tier["dram"] == 0
    first.engine.offload.wait_idle()
    close_llm(first)
    with daemon.client() as c:
        assert c.stats()["tiers"]["dram"]["blocks"] >= 12  # write-through saved every full block
    second = offload_llm(tiny_model_dir, daemon)  # empty HBM: only the store can serve
    out = second.generate([prompt], GREEDY)[0]
    close_llm(second)
    assert out.token_ids == reference(prompt)
    assert out.cached_tokens_by_tier["dram"] == 12 * 16
    assert out.num_cached_tokens == 12 * 16
    assert out.cached_tokens_by_tier["hbm"] == 0


def test_restore_from_ssd_after_daemon_restart(tiny_model_dir, make_daemon, reference,
                                               tmp_path) -> None:
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    daemon = make_daemon(dram="64MiB", ssd_dir=ssd, ssd_size="64MiB")
    prompt = random_prompt(1000, 16 * 10 + 3, seed=2)
    llm = offload_llm(tiny_model_dir, daemon)
    llm.generate([prompt], GREEDY)
    llm.engine.offload.wait_idle()
    close_llm(llm)
    daemon.stop()  # SIGTERM: DRAM is flushed to SSD, then the daemon exits
    daemon = make_daemon(dram="64MiB", ssd_dir=ssd, ssd_size="64MiB")
    llm = offload_llm(tiny_model_dir, daemon)
    out = llm.generate([prompt], GREEDY)[0]
    close_llm(llm)
    assert out.token_ids == reference(prompt)
    assert out.cached_tokens_by_tier["ssd"] == 10 * 16


def test_hbm_hit_first_then_store_for_the_rest(tiny_model_dir, make_daemon, reference) -> None:
    daemon = make_daemon(dram="64MiB")
    prompt = random_prompt(1000, 16 * 8 + 1, seed=3)
    store_through_an_engine(tiny_model_dir, daemon, [prompt])
    reader = offload_llm(tiny_model_dir, daemon)
    head = prompt[:16 * 3 + 2]  # puts blocks 0..2 into this engine's HBM
    reader.generate([head], GREEDY)
    out = reader.generate([prompt], GREEDY)[0]
    close_llm(reader)
    assert out.token_ids == reference(prompt)
    assert out.cached_tokens_by_tier["hbm"] == 3 * 16
    assert out.cached_tokens_by_tier["dram"] == 5 * 16


def _a_again_after_b(llm, seed: int):
    """Prompt a, then b (which evicts a's blocks from a 16-block HBM), then a again once the
    offload is idle (what a left behind has landed in the store); the llm is closed after.
    (a, a's second output, the engine's kv_offload stats.)"""
    a = random_prompt(1000, 16 * 10 + 4, seed=seed)
    b = random_prompt(1000, 16 * 10 + 4, seed=seed + 1)
    try:
        llm.generate([a], GREEDY)
        llm.generate([b], GREEDY)
        llm.engine.offload.wait_idle()
        out = llm.generate([a], GREEDY)[0]
        stats = llm.engine.stats()["kv_offload"]
        llm.engine.block_manager.check_integrity()
    finally:
        close_llm(llm)
    return a, out, stats


def test_evict_policy_hands_blocks_over_and_gets_them_back(tiny_model_dir, make_daemon,
                                                          reference) -> None:
    daemon = make_daemon(dram="64MiB")
    # 16 blocks of HBM: the second prompt evicts the first one's blocks from this engine.
    llm = offload_llm(tiny_model_dir, daemon, num_kv_blocks=16, kv_offload_policy="evict",
                       kv_offload_restore="always")
    a, out, stats = _a_again_after_b(llm, seed=4)
    assert out.token_ids == reference(a)
    assert out.cached_tokens_by_tier["dram"] > 0
    assert stats["evictions_published"] > 0


def test_a_likely_hit_is_restored_in_the_lookups_round_trip(tiny_model_dir, make_daemon,
                                                          reference) -> None:
    daemon = make_daemon(dram="64MiB")
    # 16 blocks of HBM: b evicts a's blocks, which this engine saved (write-through), so a's
    # return is a likely hit: restored ahead, its load riding on the lookup.
    llm = offload_llm(tiny_model_dir, daemon, num_kv_blocks=16, kv_offload_restore="always")
    a, out, stats = _a_again_after_b(llm, seed=14)
    assert out.token_ids == reference(a)
    assert out.cached_tokens_by_tier["dram"] > 0
    assert stats["restores_ahead"] == stats["restores_landed_ahead"] == 1
    assert stats.get("loads", 0) == 0  # the one restore needed no load request of its own


def test_no_daemon_engine_serves_and_counts(tiny_model_dir, reference, tmp_path) -> None:
    prompt = random_prompt(1000, 40, seed=6)
    llm = LLM(str(tiny_model_dir), device="cpu", kv_offload=True, num_kv_blocks=64,
              kv_store_socket=str(tmp_path / "nobody-here.sock"))
    out = llm.generate([prompt], GREEDY)[0]
    stats = llm.engine.stats()["kv_offload"]
    close_llm(llm)
    assert out.token_ids == reference(prompt)
    assert stats["connector"]["connect_failures"] >= 1


def test_daemon_killed_then_back_engine_keeps_serving_and_reconnects(
        tiny_model_dir, make_daemon, reference, tmp_path) -> None:
    daemon = make_daemon(dram="64MiB")
    llm = offload_llm(tiny_model_dir, daemon)
    first = random_prompt(1000, 16 * 6 + 1, seed=7)
    llm.generate([first], GREEDY)
    llm.engine.offload.wait_idle()
    daemon.kill9()
    second = random_prompt(1000, 16 * 6 + 1, seed=8)
    assert llm.generate([second], GREEDY)[0].token_ids == reference(second)
    revived = make_daemon(dram="64MiB", socket_path=daemon.socket_path)
    third = random_prompt(1000, 16 * 6 + 1, seed=9)

    def reconnected() -> bool:
        llm.generate([third], GREEDY)
        return llm.engine.stats()["kv_offload"]["connector"].get("connects", 0) >= 2

    assert wait_until(reconnected, timeout_s=15.0, interval_s=0.2)

    seeds = iter(range(10, 1000))

    def saving_again() -> bool:  # wait_idle gives up early if a probe is late on a busy host
        # A new prompt each time: one computed before the link was up again (a loaded host
        # reconnects late) is an HBM hit from then on and never saved.
        llm.generate([random_prompt(1000, 16 * 6 + 1, seed=next(seeds))], GREEDY)
        llm.engine.offload.wait_idle()
        with revived.client() as c:
            return c.stats()["tiers"]["dram"]["blocks"] > 0

    assert wait_until(saving_again, timeout_s=15.0, interval_s=0.2)
    close_llm(llm)


def test_small_remainders_skip_the_store(tiny_model_dir, make_daemon, reference) -> None:
    daemon = make_daemon(dram="64MiB")
    prompt = random_prompt(1000, 16 * 6 + 1, seed=15)
    store_through_an_engine(tiny_model_dir, daemon, [prompt])
    reader = offload_llm(tiny_model_dir, daemon)
    reader.engine.offload.restore_policy.observe_step(10**9, 1.0)  # recompute looks instant
    out = reader.generate([prompt], GREEDY)[0]
    stats = reader.engine.stats()["kv_offload"]
    close_llm(reader)
    assert out.token_ids == reference(prompt)
    assert out.cached_tokens_by_tier["dram"] == 0
    assert stats["lookups_skipped_small"] == 1 and stats.get("lookups", 0) == 0


def test_lookup_limit_leaves_a_token_to_compute(tiny_model_dir, make_daemon, reference) -> None:
    # A prompt of exactly N full blocks: the last block is never restored (its logits are needed).
    daemon = make_daemon(dram="64MiB")
    prompt = random_prompt(1000, 16 * 6, seed=10)
    store_through_an_engine(tiny_model_dir, daemon, [prompt + [5]])
    reader = offload_llm(tiny_model_dir, daemon)
    out = reader.generate([prompt], GREEDY)[0]
    close_llm(reader)
    assert out.token_ids == reference(prompt)
    assert out.cached_tokens_by_tier["dram"] == 5 * 16


def test_reset_prefix_cache_sends_the_next_hit_to_the_store(tiny_model_dir, make_daemon,
                                                            reference) -> None:
    daemon = make_daemon(dram="64MiB")
    prompt = random_prompt(1000, 16 * 7 + 2, seed=11)
    llm = offload_llm(tiny_model_dir, daemon, kv_offload_restore="always")  # not the policy's call
    llm.generate([prompt], GREEDY)
    assert llm.generate([prompt], GREEDY)[0].cached_tokens_by_tier["hbm"] == 7 * 16
    llm.engine.offload.wait_idle()
    assert llm.engine.reset_prefix_cache() >= 7
    llm.engine.block_manager.check_integrity()
    out = llm.generate([prompt], GREEDY)[0]
    close_llm(llm)
    assert out.token_ids == reference(prompt)
    assert out.cached_tokens_by_tier == {"hbm": 0, "hbm_peer": 0, "dram": 7 * 16, "ssd": 0,
                                         "remote": 0}


def test_cost_model_declines_a_restore_slower_than_recompute(tiny_model_dir, make_daemon,
                                                             reference) -> None:
    daemon = make_daemon(dram="64MiB")
    prompt = random_prompt(1000, 16 * 6 + 1, seed=12)
    store_through_an_engine(tiny_model_dir, daemon, [prompt])
    reader = offload_llm(tiny_model_dir, daemon)
    for _ in range(2):  # the first sample is the tier's warm-up, the second its bandwidth
        reader.engine.offload.restore_policy.observe_load("dram", 1, 1.0)  # looks hopeless
    out = reader.generate([prompt], GREEDY)[0]
    stats = reader.engine.stats()["kv_offload"]
    close_llm(reader)
    assert out.token_ids == reference(prompt)
    assert out.cached_tokens_by_tier["dram"] == 0
    assert stats["restores_declined"] == 1
    with daemon.client() as c:
        assert wait_until(lambda: c.stats()["leases"] == 0, timeout_s=5.0)  # lease given back
    forced = offload_llm(tiny_model_dir, daemon, kv_offload_restore="always")
    for _ in range(2):
        forced.engine.offload.restore_policy.observe_load("dram", 1, 1.0)
    out = forced.generate([prompt], GREEDY)[0]
    close_llm(forced)
    assert out.cached_tokens_by_tier["dram"] == 6 * 16


def test_restore_waits_for_blocks_instead_of_giving_up(tiny_model_dir, make_daemon,
                                                       reference) -> None:
    # Two long prompts arrive together in an arena that holds only one of them: the second's
    # restore must wait for blocks (keeping its lease) rather than fall back to recompute.
    daemon = make_daemon(dram="64MiB")
    a = random_prompt(1000, 16 * 9 + 3, seed=13)
    b = random_prompt(1000, 16 * 9 + 3, seed=14)
    store_through_an_engine(tiny_model_dir, daemon, [a, b])
    reader = offload_llm(tiny_model_dir, daemon, num_kv_blocks=14)
    outs = reader.generate([a, b], GREEDY)
    stats = reader.engine.stats()["kv_offload"]
    reader.engine.block_manager.check_integrity()
    close_llm(reader)
    assert [o.token_ids for o in outs] == [reference(a), reference(b)]
    assert [o.cached_tokens_by_tier["dram"] for o in outs] == [9 * 16, 9 * 16]
    assert stats.get("restores_waited_for_slots", 0) >= 1
    assert stats.get("restores_no_blocks", 0) == 0


def test_daemon_killed_while_a_restore_is_in_flight(tiny_model_dir, make_daemon,
                                                    reference) -> None:
    daemon = make_daemon(dram="64MiB")
    prompt = random_prompt(1000, 16 * 40 + 3, seed=16)
    store_through_an_engine(tiny_model_dir, daemon, [prompt])
    reader = offload_llm(tiny_model_dir, daemon, kv_offload_restore="always")
    engine = reader.engine
    engine.add_request("r", prompt, GREEDY)
    engine.step()  # admits it: the store lookup is now in flight, the request LOADING
    assert engine.stats()["num_loading"] == 1
    daemon.kill9()
    final = None
    give_up_at = time.monotonic() + 60.0  # bounded: every store wait has a deadline (~12 s)
    while final is None and time.monotonic() < give_up_at:  # steps may wait 5 ms, or none
        for out in engine.step():
            if out.finished:
                final = out
    engine.block_manager.check_integrity()
    stats = engine.stats()
    close_llm(reader)
    assert final is not None, stats  # the engine's counters say where the request waits
    assert final.token_ids == reference(prompt)


def test_offload_counters_reach_the_servers_metrics(tiny_model_dir, make_daemon) -> None:
    from server.metrics import ServerMetrics

    daemon = make_daemon(dram="64MiB")
    llm = offload_llm(tiny_model_dir, daemon)
    llm.generate([random_prompt(1000, 16 * 4 + 1, seed=17)], GREEDY)
    llm.engine.offload.wait_idle()
    llm.generate([[7] * 4], GREEDY)  # more steps (never a full block): the snapshot sees the saves
    metrics = ServerMetrics("tiny", llm.engine)
    metrics.update_engine(llm.engine.stats(), num_in_flight=0)
    text = metrics.render().decode()
    close_llm(llm)
    # Counts are counters; levels (loads in flight, saves in flight) are a separate gauge.
    assert ('kvengine:kv_offload_events_total{engine="0",event="blocks_saved",'
            'model_name="tiny"} 4.0' in text)
    assert 'event="connects"' in text
    assert '# TYPE kvengine:kv_offload_events_total counter' in text
    assert ('kvengine:kv_offload_in_flight{engine="0",model_name="tiny",'
            'what="saves_in_flight"}' in text)
    assert 'event="saves_in_flight"' not in text
    # The store's tiers are the external prefix cache, as vLLM names a connector's hits.
    assert 'vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"}' in text
    assert ('kvengine:external_prefix_cache_hits_by_tier_total{engine="0",model_name="tiny",'
            'tier="dram"}' in text)
    # The restore policy's estimates (why a restore would lose), as gauges.
    assert '# TYPE kvengine:kv_offload_restore_estimate gauge' in text
    assert 'what="prefill_tokens_per_s"' in text and 'what="bandwidth_dram_bytes_per_s"' in text


def test_a_chunks_blocks_reach_the_store_only_once_its_device_work_is_done(
        tiny_model_dir, make_daemon, reference) -> None:
    """On a GPU a mid-prompt chunk samples nothing, so nothing waits for its kernels: the step
    after it used to send the chunk's saves (and publish its blocks as resident) while the
    kernels could still be writing them, and the daemon copies on a stream of its own. Seen on
    two H200s: one restored prompt of eight differed from what its engine computed. Here the
    device's completion is a gate the test opens (a CPU engine's work is done when the call
    returns): until it opens, no block of the chunks reaches the daemon."""
    daemon = make_daemon(dram="64MiB")
    llm = offload_llm(tiny_model_dir, daemon, max_num_batched_tokens=32)
    engine = llm.engine
    done = False
    engine.runner.ops.work_done_marker = lambda: (lambda: done)  # the device, not yet done
    prompt = random_prompt(1000, 16 * 6 + 3, seed=31)
    engine.add_request("r", prompt, GREEDY)
    for _ in range(3):  # three mid-prompt chunks of 32 tokens: six full blocks
        engine.step()
    engine.flush_offload()
    with daemon.client() as c:
        events = c.stats()["daemon"]["events"]
    stats = engine.stats()["kv_offload"]
    assert stats.get("saves", 0) == 0 and stats["resident_deferred"] >= 1, stats
    assert events.get("blocks_saved", 0) == 0, events
    assert events.get("blocks_published_resident", 0) == 0, events
    done = True  # the kernels finished: everything goes out
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush_offload()
    engine.offload.wait_idle()
    with daemon.client() as c:
        events = c.stats()["daemon"]["events"]
    assert events["blocks_saved"] == len(prompt) // 16, events
    assert events["blocks_published_resident"] >= 6, events
    close_llm(llm)
    # and what was saved is what a fresh engine restores, token for token
    fresh = offload_llm(tiny_model_dir, daemon, kv_offload_restore="always")
    out = fresh.generate([prompt], GREEDY)[0]
    close_llm(fresh)
    assert out.cached_tokens_by_tier["dram"] > 0
    assert out.token_ids == reference(prompt)
