"""A restore in a busy engine (a real daemon): while another user's long cold prompt is being
prefilled chunk by chunk, a request whose history the store holds has its load started at once
(a load costs no step budget) and gets its first token within a step or two of the load
landing, not after the long prompt's remaining chunks; greedy tokens stay those of a run
without any cache. ``fcfs`` (the old order) is the contrast that shows the test can fail."""

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

BUDGET = 64
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG_TOKENS = 1600  # 25 chunks of BUDGET


def reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", enable_prefix_caching=False, num_kv_blocks=160)
    try:
        return [o.token_ids for o in llm.generate(prompts, PARAMS)]
    finally:
        llm.close()


def run_restore_beside_long_prefill(model_dir, daemon, order: str, history, turn):
    """(steps from the turn's arrival to its first token, long prompt tokens still to prefill
    then, tokens by request, the turn's restored tokens)."""
    llm = offload_llm(model_dir, daemon, num_kv_blocks=200, max_num_batched_tokens=BUDGET,
                      prefill_order=order, kv_offload_restore="always")
    engine = llm.engine
    long_prompt = random_prompt(1000, LONG_TOKENS, seed=41)
    first: list[tuple[int, int]] = []  # (steps to the turn's first token, long tokens left)

    def note_first_token(index: int, outputs: list) -> None:
        if not first and any(out.request_id == "turn" for out in outputs):
            long_seq = engine.scheduler._by_id["long"]
            first.append((index + 1, LONG_TOKENS - long_seq.num_computed_tokens))
    try:
        engine.add_request("long", long_prompt, PARAMS)
        for _ in range(3):  # the long prompt is mid-prefill
            engine.step()
        engine.add_request("turn", turn, PARAMS)
        tokens, restored = step_until_done(engine, waits_per_step=40,
                                           on_step=note_first_token)
    finally:
        close_llm(llm)
    first_token_after, long_left = first[0] if first else (None, None)
    return first_token_after, long_left, tokens, restored, long_prompt


@pytest.fixture
def stored_history(tiny_model_dir, make_daemon):
    daemon = make_daemon(dram="64MiB")
    history = random_prompt(1000, 16 * 20 + 7, seed=40)
    store_through_an_engine(tiny_model_dir, daemon, [history])
    turn = history + random_prompt(1000, 9, seed=42)  # the user's next message
    return daemon, history, turn


def test_a_restore_does_not_wait_behind_a_long_cold_prefill(tiny_model_dir,
                                                            stored_history) -> None:
    daemon, history, turn = stored_history
    first_after, long_left, tokens, restored, long_prompt = run_restore_beside_long_prefill(
        tiny_model_dir, daemon, "shortest-first", history, turn)
    assert restored == 20 * 16  # its history came from the store
    assert first_after <= 3  # arrival + load landing + one step
    assert long_left >= LONG_TOKENS - 8 * BUDGET  # most of the long prompt was still to come
    assert [tokens["long"], tokens["turn"]] == reference(tiny_model_dir, [long_prompt, turn])


def test_fcfs_makes_the_restore_wait_for_the_long_prefill(tiny_model_dir,
                                                          stored_history) -> None:
    daemon, history, turn = stored_history
    first_after, long_left, tokens, restored, long_prompt = run_restore_beside_long_prefill(
        tiny_model_dir, daemon, "fcfs", history, turn)
    assert restored == 20 * 16
    assert long_left <= 0  # the old order: behind every remaining chunk of the long prompt
    assert first_after >= LONG_TOKENS // BUDGET - 4
    assert [tokens["long"], tokens["turn"]] == reference(tiny_model_dir, [long_prompt, turn])
