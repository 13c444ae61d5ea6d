"""A restore never takes the blocks that running prompts still need (``engine/scheduler.py``,
``BlockManager.owed_to_running``). A restore reserves its whole hit at once, where a prefill
takes a chunk's blocks a step at a time; when it took the blocks that the prompts being
prefilled still needed, the newest of them was preempted and computed again (on two H200s,
the long-context preset's last first turns of a burst came 2 s later with offload than
without). Now the restore waits for blocks until they are spare, and nobody is preempted.
Real daemon, tiny CPU model; greedy tokens stay those of a run without any cache."""

from __future__ import annotations

import pytest
from offload_helpers import (
    close_llm,
    offload_llm,
    random_prompt,
    step_until_done,
    store_through_an_engine,
)

from engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BUDGET = 64  # four blocks a step
NUM_KV_BLOCKS = 56
LONG_BLOCKS = 25  # each long prompt: 25 blocks, prefilled four at a time


def _reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", enable_prefix_caching=False, num_kv_blocks=200)
    try:
        return [o.token_ids for o in llm.generate(prompts, PARAMS)]
    finally:
        llm.close()


@pytest.mark.timeout(180)
def test_a_restore_beside_two_long_prefills_preempts_neither(tiny_model_dir,
                                                             make_daemon) -> None:
    daemon = make_daemon(dram="64MiB")
    history = random_prompt(1000, 16 * 20 + 7, seed=50)
    store_through_an_engine(tiny_model_dir, daemon, [history])
    turn = history + random_prompt(1000, 9, seed=51)
    longs = [random_prompt(1000, 16 * LONG_BLOCKS, seed=52 + i) for i in range(2)]
    llm = offload_llm(tiny_model_dir, daemon, num_kv_blocks=NUM_KV_BLOCKS,
                      max_num_batched_tokens=BUDGET, kv_offload_restore="always")
    engine = llm.engine
    try:
        for i, prompt in enumerate(longs):
            engine.add_request(f"long{i}", prompt, PARAMS)
        for _ in range(4):  # both long prompts are mid-prefill, holding part of their blocks
            engine.step()
        engine.add_request("turn", turn, PARAMS)
        tokens, restored = step_until_done(engine)
        preemptions = engine.scheduler.num_preemptions
        waited = engine.stats()["kv_offload"].get("restores_waited_for_slots", 0)
    finally:
        close_llm(llm)
    assert preemptions == 0
    assert waited >= 1  # it did wait for the prompts' blocks
    assert restored == 20 * 16  # and was still restored, not recomputed
    expected = _reference(tiny_model_dir, [*longs, turn])
    assert [tokens["long0"], tokens["long1"], tokens["turn"]] == expected
