"""vLLM's ``kv_role`` on the kvstore connector, as a disaggregated deployment uses it: a
``kv_producer`` (prefill) instance computes and stores, a ``kv_consumer`` (decode) instance
loads what the producer stored and keeps what it computes itself. Two real vLLM processes on CPU,
one real daemon."""

from __future__ import annotations

import time

import pytest
from daemon_helpers import wait_until
from vllm_parts import (
    BLOCK_SIZE,
    assert_same_logprobs,
    engines_up,
    full_blocks_tokens,
    prompt,
    running_daemon,
)

from kvstore.testing.vllm_process import VllmProcess

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("vllm-roles")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def engines(small_model_dir, store):
    with engines_up({role: VllmProcess(small_model_dir, store.socket_path,
                                       {"lookup_timeout_s": 5.0}, wait=False,
                                       engine_args={"kv_role": f"kv_{role}"})
                     for role in ("producer", "consumer")}) as procs:
        yield procs


def _daemon_counts(store) -> tuple[int, int]:
    """(blocks in DRAM, save requests answered)."""
    with store.client() as c:
        stats = c.stats()
    return int(stats["tiers"]["dram"]["blocks"]), int(stats["daemon"]["requests"].get("save", 0))


def test_a_consumer_loads_what_a_producer_computed_and_stores_nothing(engines, store) -> None:
    p = prompt(70)
    blocks_before, _ = _daemon_counts(store)
    produced = engines["producer"].ask(p)
    assert produced["num_cached_tokens"] == 0
    assert produced["store_events"].get("scheduler_lookups", 0) == 0  # a producer never asks
    assert produced["store_events"].get("scheduler_blocks_save_planned", 0) > 0
    num_blocks = len(p) // BLOCK_SIZE
    assert wait_until(lambda: _daemon_counts(store)[0] >= blocks_before + num_blocks, 10.0)
    consumed = engines["consumer"].ask(p)
    assert consumed["num_cached_tokens"] == full_blocks_tokens(len(p))
    assert_same_logprobs(consumed, produced)
    assert consumed["store_events"].get("scheduler_blocks_save_planned", 0) == 0
    counts = _daemon_counts(store)
    engines["consumer"].ask(prompt(71))  # computed by the consumer: never saved
    time.sleep(1.0)  # a save would have been sent at the end of the step that computed it
    assert _daemon_counts(store) == counts
