"""After a daemon restart the engine saves again what it saved before (issue 21, item 6).

A real CPU engine with write-through saves three prompts into a real daemon; the daemon is killed
with SIGKILL and a new one starts on the same socket (empty DRAM). Serving the same prompts again
must fill the new daemon: the engine's idea of what the store holds (its saved keys) is reset when
it reconnects, so a fresh engine then restores the prompts from DRAM.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import wait_until

from engine import LLM, SamplingParams

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
NUM_FULL_BLOCKS = 6


def _prompts() -> list[list[int]]:
    return [np.random.default_rng(40 + i).integers(10, 1000, 16 * NUM_FULL_BLOCKS + 3).tolist()
            for i in range(3)]


def _dram_blocks(daemon) -> int:
    with daemon.client() as c:
        return c.stats()["tiers"]["dram"]["blocks"]


def _engine(model_dir: Path, daemon) -> LLM:
    return LLM(str(model_dir), device="cpu", kv_offload=True, num_kv_blocks=64,
               kv_store_socket=str(daemon.socket_path))


def test_the_engine_saves_again_into_a_restarted_daemon(tiny_model_dir, make_daemon):
    prompts = _prompts()
    daemon = make_daemon(dram="64MiB")
    llm = _engine(tiny_model_dir, daemon)
    try:
        llm.generate(prompts, GREEDY)
        llm.engine.offload.wait_idle()
        assert _dram_blocks(daemon) == 3 * NUM_FULL_BLOCKS
        socket_path = daemon.socket_path
        daemon.kill9()
        daemon = make_daemon(dram="64MiB", socket_path=socket_path)
        assert _dram_blocks(daemon) == 0

        def served_again() -> bool:
            llm.generate(prompts, GREEDY)  # the same prompts, as often as it takes to reconnect
            llm.engine.offload.wait_idle()
            return _dram_blocks(daemon) == 3 * NUM_FULL_BLOCKS

        assert wait_until(served_again, 20.0, interval_s=0.2), (
            f"the restarted daemon holds {_dram_blocks(daemon)} blocks; the engine's offload "
            f"stats: {llm.engine.stats()['kv_offload']}")
        assert llm.engine.stats()["kv_offload"]["store_resets"] >= 1
    finally:
        llm.close()
    fresh = _engine(tiny_model_dir, daemon)  # empty HBM: only the store can serve the prefix
    try:
        out = fresh.generate([prompts[0]], GREEDY)[0]
    finally:
        fresh.close()
    assert out.cached_tokens_by_tier["dram"] == NUM_FULL_BLOCKS * 16
