"""While the device runs a step, a request that arrives is taken in at once with a store: its
lookup goes out and is answered during the step, so the next schedule does not wait a round
trip for it. Without a store the step does not watch for arrivals. A real daemon; the device's
step stood in for by an event the test sets (the CPU backend's steps end at once)."""

from __future__ import annotations

import threading
import time

import pytest
from offload_helpers import close_llm, offload_llm, random_prompt

from engine import LLM, SamplingParams
from engine.step_timing import StepTiming

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
DEVICE_S = 1.0  # the stood-in step's device time
ARRIVES_AFTER_S = 0.2


def _previous_step(execute_s: float) -> StepTiming:
    return StepTiming(flush_s=0.0, add_s=0.0, schedule_s=0.0, execute_s=execute_s,
                      total_s=execute_s, num_seqs=1, num_tokens=1, num_loading=0)


def test_an_arrival_during_the_step_is_looked_up_during_it(tiny_model_dir, make_daemon) -> None:
    daemon = make_daemon()
    llm = offload_llm(tiny_model_dir, daemon, kv_offload_restore="always")
    try:
        engine = llm.engine
        assert engine.offload.client.wait_available(10.0)
        engine.last_waited_step = _previous_step(2 * DEVICE_S)  # the watch covers the whole step
        device = threading.Event()
        adder = threading.Timer(ARRIVES_AFTER_S, engine.add_request,
                                ("late", random_prompt(1000, 16 * 6, seed=4), PARAMS))
        ender = threading.Timer(DEVICE_S, device.set)
        started = time.monotonic()
        adder.start()
        ender.start()
        engine._during_step(device.is_set)
        returned = time.monotonic() - started
        adder.join()
        ender.join()
        seq = engine.scheduler._by_id["late"]  # taken in during the step
        job = engine.offload.restores.prefetched.get("late")
        # its lookup went out and came back while the device ran (a miss: nothing stored)
        assert seq.offload_checked or (job is not None and job.lookup.poll())
        assert DEVICE_S * 0.9 <= returned < DEVICE_S + 0.5, returned
    finally:
        close_llm(llm)


@pytest.fixture
def store_engine(tiny_model_dir, make_daemon):
    """An engine with a store (a real daemon), registered."""
    llm = offload_llm(tiny_model_dir, make_daemon())
    try:
        assert llm.engine.offload.client.wait_available(10.0)
        yield llm.engine
    finally:
        close_llm(llm)


def test_the_watch_ends_with_its_share_of_the_last_step(store_engine) -> None:
    store_engine.last_waited_step = _previous_step(0.5)
    started = time.monotonic()
    store_engine._during_step(lambda: False)  # a device that never ends: the share bounds it
    waited = time.monotonic() - started
    assert 0.35 <= waited < 1.5, waited  # 0.8 x 0.5 s, and not for ever


def test_without_a_store_the_step_does_not_watch(tiny_model_dir) -> None:
    with LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64) as llm:
        llm.engine.last_waited_step = _previous_step(10.0)
        started = time.monotonic()
        llm.engine._during_step(lambda: False)
        assert time.monotonic() - started < 1.0  # not the 8 s a store's watch would take


def test_a_step_the_host_does_not_wait_for_is_not_watched(store_engine) -> None:
    """Mid-prompt chunks: the step takes what arrived (its lookup goes out) and returns at
    once, so the host queues the next chunk while the device computes this one."""
    store_engine.last_waited_step = _previous_step(10.0)
    store_engine.add_request("early", random_prompt(1000, 16 * 6, seed=5), PARAMS)
    started = time.monotonic()
    store_engine._during_step(lambda: False, host_waits=False)
    assert time.monotonic() - started < 1.0  # not the 8 s a watch would take
    assert "early" in store_engine.scheduler._by_id  # taken in: its lookup is out
