"""The store costs a new request no engine step: its lookup is sent on arrival, a reply still
on its way when the request is admitted is waited for (a bounded wait per step), and the saves a
step makes are sent after its tokens went out."""

from __future__ import annotations

import time

import pytest
from offload_helpers import close_llm, offload_llm, random_prompt, store_through_an_engine

from engine import SamplingParams
from offload.transfer import Transfer

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def test_a_missed_lookup_does_not_cost_a_step(tiny_model_dir, make_daemon) -> None:
    # empty: every lookup misses; without its key filter, which would spare the lookup
    daemon = make_daemon("--key-filter", "off", dram="64MiB")
    reader = offload_llm(tiny_model_dir, daemon, num_kv_blocks=64)
    engine = reader.engine
    engine.add_request("x", random_prompt(1000, 16 * 8 + 3, seed=31), PARAMS)
    first = engine.step()
    counters = engine.offload.counters
    close_llm(reader)
    assert counters["lookups"] == 1
    # Answered within the step's bound (the usual case): a miss, prefilled in that same step.
    on_time = counters["lookups_answered_on_time"] == 1
    assert on_time == (len(first) == 1) == (counters["restores_miss"] == 1)
    assert counters["lookups_answered_on_time"] + counters["lookups_answered_late"] == 1


def test_a_queued_request_uses_the_lookup_sent_on_arrival(tiny_model_dir, make_daemon) -> None:
    daemon = make_daemon("--key-filter", "off", dram="64MiB")  # "x" asked for, held nowhere
    reader = offload_llm(tiny_model_dir, daemon, num_kv_blocks=64, max_num_seqs=1)
    engine = reader.engine
    engine.add_request("busy", random_prompt(1000, 40, seed=32), SamplingParams(max_tokens=6,
                                                                          ignore_eos=True))
    engine.step()
    engine.add_request("x", random_prompt(1000, 16 * 8 + 3, seed=33), PARAMS)
    engine.step()  # "x" arrives and queues behind "busy": its lookup goes out now
    assert engine.offload.restores.prefetched["x"].lookup.wait(10.0)
    busy_done = x_first = None
    for step in range(100):
        for out in engine.step():
            if out.request_id == "busy" and out.finished:
                busy_done = step
            if out.request_id == "x" and x_first is None:
                x_first = step
        if x_first is not None:
            break
    counters = engine.offload.counters
    close_llm(reader)
    assert counters["lookups_at_arrival"] == 2 and counters["lookups"] == 2
    # "busy"'s own lookup may miss its 2 ms on a loaded machine; "x"'s was answered (waited for
    # above) before "x" reached the head of the queue, so it never waits in LOADING.
    assert counters["lookups_answered_late"] <= 1
    assert x_first == busy_done + 1  # admitted the step after "busy" left, prefilled at once


@pytest.mark.parametrize("max_tokens", [3, 1])  # 1: the sequence finishes in the prefill step
def test_a_steps_saves_go_out_after_its_tokens(tiny_model_dir, make_daemon,
                                               max_tokens: int) -> None:
    """Write-through pins the step's new full blocks inside the step, but builds and sends the
    save after the step returned its outputs (``flush_offload``, or the next step), also when
    the sequence has finished and given its blocks back meanwhile."""
    daemon = make_daemon(dram="64MiB")
    reader = offload_llm(tiny_model_dir, daemon, num_kv_blocks=64)
    engine = reader.engine
    engine.add_request("x", random_prompt(1000, 16 * 8 + 3, seed=34),
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outs = []
    while not outs:
        outs = engine.step()  # the prefill step (after the lookup)
    offload = engine.offload
    queued = [block for job in offload.saves.saver.pinned for block in job.slots.block_ids]
    assert len(queued) == 8 and offload.counters["saves"] == 0
    holders = 1 if max_tokens == 1 else 2  # the pin (+ the running sequence)
    assert all(engine.block_manager._ref_counts[b] == holders for b in queued)
    engine.flush_offload()
    assert offload.counters["saves"] == 1 and not offload.saves.saver.pinned
    offload.wait_idle()
    with daemon.client() as c:
        assert c.stats()["tiers"]["dram"]["blocks"] == 8
    engine.block_manager.check_integrity()
    close_llm(reader)


def test_a_request_finishes_when_its_reply_came_not_when_it_was_polled(make_daemon) -> None:
    # The restore policy measures loads by these times: a reply polled a long step later must
    # not read as a slow bus.
    daemon = make_daemon(dram="64MiB")
    with daemon.client() as client:
        transfer = Transfer(deadline_s=10.0, fallback=None, on_error=lambda code: None)
        pending = client.lookup_async(b"n" * 16, [b"h" * 16], [b"i" * 8])
        transfer.attach(pending)
        deadline = time.monotonic() + 10.0
        while not pending.poll() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.3)  # a long step before the engine polls it
        polled_at = time.monotonic()
        assert transfer.poll() and transfer.ok
    assert transfer.finished_at == pending.landed_at
    assert transfer.finished_at <= polled_at - 0.29
    assert transfer.elapsed_s < 0.3


def test_a_restore_starts_during_the_step_its_request_arrived_in(tiny_model_dir,
                                                                 make_daemon) -> None:
    """A request that arrives while the device runs a step, with its prefix in the store:
    once its lookup is answered, still inside that step, its restore starts (LOADING when the
    step returns, before any further schedule) and lands with the stored blocks."""
    daemon = make_daemon(dram="64MiB")
    stored = random_prompt(1000, 16 * 6, seed=35)
    store_through_an_engine(tiny_model_dir, daemon, [stored])
    reader = offload_llm(tiny_model_dir, daemon, num_kv_blocks=64)
    engine = reader.engine
    engine.add_request("busy", random_prompt(1000, 40, seed=36),
                       SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    execute = engine.runner.execute
    restores = engine.offload.restores

    def arriving(batch, while_device_runs=None):
        def hook(device_done, host_waits=True):
            engine.runner.execute = execute  # once
            engine.add_request("x", stored + [7, 8, 9], PARAMS)
            engine._take_inbox()  # what the hook does first: the lookup goes out
            assert restores.prefetched["x"].lookup.wait(10.0)
            while_device_runs(device_done, host_waits)
        return execute(batch, while_device_runs=hook)

    engine.runner.execute = arriving
    engine.step()
    assert "x" in restores.restores and "x" not in restores.prefetched
    assert not any(s.request_id == "x" for s in engine.scheduler.waiting)
    assert engine.offload.counters["lookups_answered_during_step"] == 1
    outs = {}
    for _ in range(200):
        for out in engine.step():
            outs[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    counters = engine.offload.counters
    close_llm(reader)
    assert outs["x"].cached_tokens_by_tier["dram"] == 16 * 6
    # where each first token's time went, by kind: "x" restored, "busy" computed from nothing
    assert counters["first_tokens_restored"] == counters["first_tokens_cold"] == 1
    assert counters["first_token_ms_queued_restored"] > 0
    assert counters["first_token_ms_prefill_cold"] > 0


def test_the_wait_for_lookups_during_a_step_ends_with_the_device(tiny_model_dir,
                                                                 make_daemon) -> None:
    """``answered_lookups`` waits for replies only while the device is busy: once it is done
    (or was never busy) it returns at once with what is answered."""
    daemon = make_daemon(dram="64MiB")
    stored = random_prompt(1000, 16 * 6, seed=37)
    store_through_an_engine(tiny_model_dir, daemon, [stored])
    reader = offload_llm(tiny_model_dir, daemon, num_kv_blocks=64)
    engine = reader.engine
    restores = engine.offload.restores
    engine.add_request("x", stored + [7], PARAMS)
    engine._take_inbox()
    seq = engine.scheduler.waiting[0]
    started = time.monotonic()
    restores.answered_lookups([seq], lambda: False, 10.0)
    assert time.monotonic() - started < 0.5  # the device was done: no wait
    assert restores.answered_lookups([seq], lambda: True, 10.0) == [seq]  # busy: waited
    engine.add_request("y", random_prompt(1000, 16 * 6, seed=38), PARAMS)
    engine._take_inbox()
    y = engine.scheduler.waiting[1]
    started = time.monotonic()
    assert restores.answered_lookups([y], lambda: True, 0.0) in ([], [y])
    assert time.monotonic() - started < 0.5  # no time left: no wait
    close_llm(reader)
