"""Helpers shared by the offload tests: prompts and engines with --kv-offload on a real daemon."""

from __future__ import annotations

import numpy as np

from engine import LLM, SamplingParams

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
