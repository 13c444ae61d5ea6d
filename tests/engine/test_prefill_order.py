"""Prefill order in a real engine: a short prompt is not held behind a long one's chunks, and a
long prompt under a stream of short ones still gets a chunk every ``max_prefill_wait_steps + 1``
steps (the aging bound), with the same greedy tokens as a run without competition."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.prefill_order import PrefillOrder

BUDGET = 64  # tokens per step: a 640-token prompt needs 10 chunks
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def prompt(num_tokens: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 1000, num_tokens).tolist()


def engine_llm(model_dir, order: str, max_wait: int = 3, **config) -> LLM:
    return LLM(str(model_dir), device="cpu", num_kv_blocks=256, max_num_batched_tokens=BUDGET,
               prefill_order=order, max_prefill_wait_steps=max_wait, **config)


def reference_tokens(model_dir, prompts: list[list[int]], params: SamplingParams) -> list:
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=256, enable_prefix_caching=False)
    try:
        return [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()


def run_long_under_shorts(model_dir, order: str, max_wait: int):
    """A 640-token prompt, then one budget-sized prompt arriving every step: the steps at which
    the long prompt got a chunk, and every request's tokens."""
    llm = engine_llm(model_dir, order, max_wait)
    engine = llm.engine
    long_prompt = prompt(640, seed=1)
    engine.add_request("long", long_prompt, GREEDY)
    chunk_steps: list[int] = []
    tokens: dict[str, list[int]] = {}
    shorts: dict[str, list[int]] = {}
    try:
        for index in range(400):
            if index < 40:
                shorts[f"s{index}"] = prompt(BUDGET, seed=100 + index)
                engine.add_request(f"s{index}", shorts[f"s{index}"], ONE_TOKEN)
            before = _computed(engine, "long")
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
            if _computed(engine, "long") > before:
                chunk_steps.append(index)
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests()
        engine.block_manager.check_integrity()
    finally:
        llm.close()
    return chunk_steps, tokens, long_prompt, shorts


def _computed(engine, request_id: str) -> int:
    """Its computed tokens (0 before it reached the scheduler; its prompt once finished)."""
    seq = engine.scheduler._by_id.get(request_id)
    if seq is not None:
        return seq.num_computed_tokens
    return 1 << 30 if engine.scheduler.num_steps else 0


def test_a_long_prompt_under_a_stream_of_short_ones_waits_at_most_its_bound(
        tiny_model_dir) -> None:
    max_wait = 3
    chunk_steps, tokens, long_prompt, shorts = run_long_under_shorts(
        tiny_model_dir, "shortest-first", max_wait)
    gaps = np.diff([-1, *chunk_steps])
    assert gaps.max() <= max_wait + 1, chunk_steps  # never waits more than its bound
    assert gaps.max() > 1, chunk_steps  # the short prompts did go first
    # 640 tokens in chunks of at most 64, one at least every max_wait + 1 steps
    assert chunk_steps[-1] <= (640 // BUDGET + 1) * (max_wait + 1)
    names = ["long", *shorts]
    expected = reference_tokens(tiny_model_dir, [long_prompt, *shorts.values()], GREEDY)
    assert tokens["long"] == expected[0]
    for name, want in zip(names[1:], expected[1:]):
        assert tokens[name] == want[:1]


def test_fcfs_keeps_the_old_order(tiny_model_dir) -> None:
    chunk_steps, _, _, _ = run_long_under_shorts(tiny_model_dir, "fcfs", 3)
    assert chunk_steps == list(range(len(chunk_steps)))  # a chunk every step until it is done


def test_a_short_prompt_goes_before_a_long_prompts_remaining_chunks(tiny_model_dir) -> None:
    llm = engine_llm(tiny_model_dir, "shortest-first")
    engine = llm.engine
    long_prompt, short = prompt(960, seed=3), prompt(40, seed=4)
    engine.add_request("long", long_prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    try:
        for _ in range(3):
            engine.step()
        engine.add_request("short", short, GREEDY)
        steps_to_first = None
        for index in range(200):
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
                if out.request_id == "short" and steps_to_first is None:
                    steps_to_first = index + 1
                    long_left = 960 - _computed(engine, "long")
            if not engine.has_unfinished_requests():
                break
    finally:
        llm.close()
    assert steps_to_first == 1  # its whole prompt in the next step, beside a smaller chunk
    assert long_left >= 960 - 5 * BUDGET
    assert [tokens["long"], tokens["short"]] == reference_tokens(
        tiny_model_dir, [long_prompt, short], GREEDY)


def test_a_latency_bound_step_caps_the_long_chunk(tiny_model_dir) -> None:
    llm = engine_llm(tiny_model_dir, "shortest-first", latency_chunk_tokens=16)
    engine = llm.engine
    long_prompt, short = prompt(640, seed=5), prompt(40, seed=6)
    engine.add_request("long", long_prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    chunks: list[tuple[int, bool]] = []  # (long's chunk, short finished its prompt that step)
    try:
        for index in range(200):
            if index == 3:
                engine.add_request("short", short, GREEDY)
            before = _computed(engine, "long")
            outs = engine.step()
            for out in outs:
                tokens[out.request_id] = out.token_ids
            first = any(o.request_id == "short" and len(o.token_ids) == 1 for o in outs)
            if _computed(engine, "long") < 1 << 30:
                chunks.append((_computed(engine, "long") - before, first))
            if not engine.has_unfinished_requests():
                break
    finally:
        llm.close()
    assert (16, True) in chunks  # the step carrying the short prompt's first token was short
    assert all(n == 16 for n, first in chunks if first)
    assert chunks[0][0] == BUDGET and chunks[1][0] == BUDGET  # alone: full chunks
    assert [tokens["long"], tokens["short"]] == reference_tokens(
        tiny_model_dir, [long_prompt, short], GREEDY)


@pytest.mark.parametrize("bad", [dict(policy="lifo"), dict(max_wait_steps=-1),
                                 dict(latency_chunk_tokens=0)])
def test_bad_prefill_order_is_refused(bad) -> None:
    with pytest.raises(ValueError):
        PrefillOrder(**bad)
