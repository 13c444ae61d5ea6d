"""A step with nothing to run but another request's restore waits for that restore's reply
(bounded, no busy loop), but a request that arrives meanwhile ends the wait at once: it never
waits for someone else's restore. A real daemon, stopped with SIGSTOP so that the restore's
lookup stays unanswered; the idle wait made long (seconds) so the difference cannot be noise."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from offload_helpers import close_llm, offload_llm, random_prompt

from engine import SamplingParams
from engine import llm_engine as llm_engine_module
from engine.llm_engine import LLMEngine
from engine.sequence import SequenceStatus

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
LONG_WAIT_S = 4.0
ARRIVES_AFTER_S = 0.3


@contextmanager
def stopped_store_engine(model_dir, make_daemon) -> Iterator[LLMEngine]:
    """An engine with --kv-offload whose daemon is stopped (SIGSTOP) once it has connected: a
    lookup sent now stays unanswered. The daemon goes on and the engine closes afterwards."""
    daemon = make_daemon("--key-filter", "off")  # else a prompt it lacks is never asked for
    llm = offload_llm(model_dir, daemon, kv_offload_restore="always")
    try:
        assert llm.engine.offload.client.wait_available(10.0)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            yield llm.engine
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        close_llm(llm)


def test_an_arrival_ends_the_wait_for_another_requests_restore(tiny_model_dir, make_daemon,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(llm_engine_module, "IDLE_RESTORE_WAIT_S", LONG_WAIT_S)
    with stopped_store_engine(tiny_model_dir, make_daemon) as engine:
        engine.add_request("restoring", random_prompt(1000, 16 * 6, seed=1), PARAMS)
        # Its lookup goes out unanswered, so nothing runs: the step waits for the reply,
        # until a request arrives during the wait; the step returns then.
        adder = threading.Timer(ARRIVES_AFTER_S, engine.add_request,
                                ("new", random_prompt(1000, 5, seed=2), PARAMS))
        started = time.monotonic()
        adder.start()
        assert engine.step() == []
        waited = time.monotonic() - started
        adder.join()
        assert engine.scheduler.num_loading == 1  # still waiting on the stopped daemon
        assert ARRIVES_AFTER_S * 0.9 <= waited < LONG_WAIT_S / 2, waited
        engine.step()  # the next step takes it in
        assert engine.scheduler._by_id["new"].status is SequenceStatus.RUNNING


@pytest.mark.parametrize("wanted", [True, False])
def test_the_restorer_waits_only_while_told(tiny_model_dir, make_daemon, wanted) -> None:
    """``wait_for_progress`` with ``keep_waiting`` false returns at once; true, it waits its
    whole timeout for a reply that does not come."""
    with stopped_store_engine(tiny_model_dir, make_daemon) as engine:
        engine.add_request("restoring", random_prompt(1000, 16 * 6, seed=3), PARAMS)
        engine.step()
        assert engine.scheduler.num_loading == 1
        started = time.monotonic()
        engine.offload.restores.wait_for_progress(0.5, lambda: wanted)
        waited = time.monotonic() - started
        assert (waited >= 0.45) if wanted else (waited < 0.1), waited
