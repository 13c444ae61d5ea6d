"""Sliding-window models on the kvstore connector, through a live vLLM (CPU) on a real daemon:
a Gemma-style model (sliding-window layers between full-attention ones, window shorter than a
block) is served with vLLM's hybrid KV cache manager off (the connector does not declare
``SupportsHMA``, so vLLM allocates every layer's blocks as full attention and keeps every block
of every layer): every full block is saved, and a hit loads them all. After vLLM's own prefix
cache is reset, the prompt comes back from the daemon with the same greedy tokens and logprobs
as the instance's own recompute."""

from __future__ import annotations

import pytest
from daemon_helpers import wait_until
from model_families import write_llama_checkpoint
from test_vllm_reset import _reset
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

WINDOW = 48  # tokens: shorter than vLLM's CPU block (128), so most blocks lie outside it


@pytest.fixture(scope="module")
def mixed_model_dir(small_model_dir, tmp_path_factory):
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return write_llama_checkpoint(tmp_path_factory.mktemp("swa") / "model", small_model_dir,
                                  layer_types, WINDOW)


def test_a_mixed_sliding_window_model_loads_its_prefix_from_the_store(mixed_model_dir,
                                                                       tmp_path) -> None:
    with running_daemon(tmp_path) as daemon, engines_up({"vllm": VllmProcess(
            mixed_model_dir, daemon.socket_path, {"retry_interval_s": 1.0},
            wait=False)}) as procs:
        vllm = procs["vllm"]
        p = prompt(71)
        hit = full_blocks_tokens(len(p))
        first = vllm.ask(p, max_tokens=8)  # computed here: vLLM's own answer
        assert first["num_cached_tokens"] == 0
        assert wait_until(lambda: dram_blocks(daemon) >= len(p) // BLOCK_SIZE, 10.0)
        # vLLM saw sliding-window layers and allocated them as full attention.
        assert any("disabled for this hybrid model" in line for line in vllm.lines)

        _reset(vllm, reset_connector=False)  # vLLM forgets; the store still has the blocks
        again = vllm.ask(p, max_tokens=8)
        assert again["num_cached_tokens"] == hit, again
        assert again["external_hits"] - first["external_hits"] >= hit
        assert_same_logprobs(again, first)
