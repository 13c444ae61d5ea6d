"""Helpers shared by the offload tests: prompts and engines with --kv-offload on a real daemon."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine import LLM, SamplingParams
from engine.sequence import SequenceStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def random_prompt(vocab_size: int, num_tokens: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab_size, num_tokens).tolist()


def offload_llm(model_dir, daemon, **kwargs) -> LLM:
    """A CPU engine with --kv-offload on ``daemon`` (64 KV blocks unless given)."""
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(str(model_dir), device="cpu", kv_offload=True,
               kv_store_socket=str(daemon.socket_path), **kwargs)


def close_llm(llm: LLM) -> None:
    llm.close()


def store_through_an_engine(model_dir, daemon, prompts: list[list[int]]) -> None:
    """A first engine computes the prompts and saves them write-through, then goes away."""
    writer = offload_llm(model_dir, daemon)
    writer.generate(prompts, GREEDY)
    writer.engine.offload.wait_idle()
    close_llm(writer)


def step_until_done(engine, waits_per_step: int = 1,
                    on_step: Callable[[int, list], None] | None = None,
                    turn_id: str = "turn") -> tuple[dict[str, list[int]], int]:
    """Step ``engine`` until no request is left (at most 400 steps; asserted); while
    ``turn_id`` is loading, wait for its load up to ``waits_per_step`` times 50 ms a step (at
    once if it landed: steps are counted, not CPU speed). ``on_step(index, outputs)`` sees each
    step's outputs. (Token ids by request, ``turn_id``'s tokens restored from DRAM.)"""
    tokens: dict[str, list[int]] = {}
    restored = 0
    for index in range(400):
        outputs = engine.step()
        for out in outputs:
            tokens[out.request_id] = out.token_ids
            if out.request_id == turn_id:
                restored = out.cached_tokens_by_tier["dram"]
        if on_step is not None:
            on_step(index, outputs)
        seq = engine.scheduler._by_id.get(turn_id)
        if seq is not None and seq.status is SequenceStatus.LOADING:
            for _ in range(waits_per_step):
                engine.offload.restores.wait_for_progress(0.05)
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_integrity()
    return tokens, restored
