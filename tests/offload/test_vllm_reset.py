"""vLLM's ``reset_prefix_cache`` through a live vLLM (CPU) with the connector on a real daemon:
vLLM's own reset leaves the store's blocks usable; with ``reset_connector`` (what
``/reset_prefix_cache?reset_connector=true`` asks) this instance never finds them again."""

from __future__ import annotations

import pytest
from daemon_helpers import wait_until
from vllm_parts import (
    BLOCK_SIZE,
    assert_same_logprobs,
    dram_blocks,
    engines_up,
    full_blocks_tokens,
    prompt,
    running_daemon,
)

from kvstore.testing.vllm_process import VllmProcess

pytestmark = pytest.mark.vllm


def _reset(vllm: VllmProcess, reset_connector: bool) -> None:
    """vLLM refuses a reset while a finished request's blocks wait for their saves to be
    reported (its next step reports them): a short request steps it, then the reset is asked
    again, a bounded number of times."""
    for seed in range(5):
        if vllm.reset_prefix_cache(reset_connector):
            return
        vllm.ask(prompt(700 + seed, 8), max_tokens=1)
    raise AssertionError(f"vLLM refused the reset five times:\n{vllm.tail()}")


def test_reset_prefix_cache_with_the_connector_forgets_the_stored_blocks(small_model_dir,
                                                                         tmp_path) -> None:
    with running_daemon(tmp_path) as daemon, engines_up({"vllm": VllmProcess(
            small_model_dir, daemon.socket_path, {"retry_interval_s": 1.0},
            wait=False)}) as procs:
        vllm = procs["vllm"]
        p = prompt(61)
        hit = full_blocks_tokens(len(p))
        first = vllm.ask(p)
        assert first["num_cached_tokens"] == 0
        assert wait_until(lambda: dram_blocks(daemon) >= len(p) // BLOCK_SIZE, 10.0)

        _reset(vllm, reset_connector=False)  # vLLM's own blocks only: the store answers
        again = vllm.ask(p)
        assert again["num_cached_tokens"] == hit, again
        assert again["external_hits"] - first["external_hits"] >= hit
        assert_same_logprobs(again, first)

        _reset(vllm, reset_connector=True)  # and the connector's: its keys change
        after = vllm.ask(p)
        assert after["num_cached_tokens"] == 0, after
        assert after["external_hits"] == again["external_hits"]
        assert_same_logprobs(after, first)
