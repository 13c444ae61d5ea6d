"""Our CPU engine against HF transformers on the same tiny random checkpoints (float32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_helpers import HFCheckpoint, random_prompts, run_forward

from engine import LLM, EngineConfig, LLMEngine, SamplingParams

ARCHS = ["qwen3", "qwen3-tied", "llama", "qwen2"]
ATOL = 2e-4


def cpu_llm(path: Path, **config: object) -> LLM:
    return LLM(str(path), device="cpu", **config)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_hf(hf_checkpoints: dict[str, HFCheckpoint], arch: str) -> None:
    ckpt = hf_checkpoints[arch]
    prompt = random_prompts(4000, [40], seed=7)[0]
    with LLMEngine(EngineConfig(str(ckpt.path), device="cpu", num_kv_blocks=16)) as engine:
        ours = run_forward(engine, prompt, 0, [9, 2, 14])  # out-of-order blocks
    np.testing.assert_allclose(ours, ckpt.logits(prompt), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prefix_read_from_blocks_matches_hf(hf_checkpoints: dict[str, HFCheckpoint], arch: str
                                            ) -> None:
    """Compute 21 tokens, then the remaining 19 attend to them through the paged cache."""
    ckpt = hf_checkpoints[arch]
    prompt = random_prompts(4000, [40], seed=8)[0]
    with LLMEngine(EngineConfig(str(ckpt.path), device="cpu", num_kv_blocks=16)) as engine:
        run_forward(engine, prompt[:21], 0, [5, 11])
        ours = run_forward(engine, prompt, 21, [5, 11, 0])
    np.testing.assert_allclose(ours, ckpt.logits(prompt)[21:], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_of_mixed_lengths_matches_hf(hf_checkpoints: dict[str, HFCheckpoint],
                                                  arch: str) -> None:
    ckpt = hf_checkpoints[arch]
    prompts = random_prompts(4000, [1, 15, 16, 17, 40], seed=9)
    with cpu_llm(ckpt.path) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == ckpt.greedy(prompt, 10)
        assert out.finish_reason == "length" and out.finished
        assert out.prompt_token_ids == prompt


def test_chunked_prefill_matches_hf(qwen3: HFCheckpoint) -> None:
    prompts = random_prompts(4000, [45, 23, 3], seed=10)
    with cpu_llm(qwen3.path, max_num_batched_tokens=8) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert llm.engine.stats()["num_steps"] > 45 // 8
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == qwen3.greedy(prompt, 8)


def test_prefix_cache_hit_gives_the_same_tokens(qwen3: HFCheckpoint) -> None:
    first, suffix = random_prompts(4000, [40, 9], seed=11)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with cpu_llm(qwen3.path) as llm:
        cold = llm.generate([first], params)[0]
        again = llm.generate([first], params)[0]
        extended = llm.generate([first + suffix], params)[0]
        stats = llm.engine.stats()
        llm.engine.block_manager.check_integrity()
    with cpu_llm(qwen3.path, enable_prefix_caching=False) as llm:
        uncached = llm.generate([first + suffix], params)[0]
    assert cold.num_cached_tokens == 0
    assert again.num_cached_tokens == 32 and again.cached_tokens_by_tier["hbm"] == 32
    assert again.token_ids == cold.token_ids == qwen3.greedy(first, 8)
    assert extended.num_cached_tokens == 32
    assert extended.token_ids == uncached.token_ids == qwen3.greedy(first + suffix, 8)
    assert uncached.num_cached_tokens == 0
    assert stats["prefix_cache_hit_tokens"]["hbm"] == 64
    assert stats["prefix_cache_queries"] == 40 + 40 + 49


def test_a_fully_cached_prompt_still_computes_its_last_block(qwen3: HFCheckpoint) -> None:
    prompt = random_prompts(4000, [32], seed=12)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with cpu_llm(qwen3.path) as llm:
        llm.generate([prompt], params)
        out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 16
    assert out.token_ids == qwen3.greedy(prompt, 4)


def test_preemption_by_recompute_keeps_greedy_output(qwen3: HFCheckpoint) -> None:
    prompts = random_prompts(4000, [10, 12, 7, 14], seed=13)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with cpu_llm(qwen3.path, block_size=4, num_kv_blocks=14) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        llm.engine.block_manager.check_integrity()
    assert stats["num_preemptions"] > 0
    assert stats["num_blocks_in_use"] == 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == qwen3.greedy(prompt, 16)


def test_tenant_salt_isolates_the_prefix_cache(qwen3: HFCheckpoint) -> None:
    prompt = random_prompts(4000, [40], seed=14)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with cpu_llm(qwen3.path) as llm:
        a1 = llm.generate([prompt], params, cache_salt="tenant-a")[0]
        b1 = llm.generate([prompt], params, cache_salt="tenant-b")[0]
        a2 = llm.generate([prompt], params, cache_salt="tenant-a")[0]
        plain = llm.generate([prompt], params)[0]
    assert (a1.num_cached_tokens, b1.num_cached_tokens, a2.num_cached_tokens) == (0, 0, 32)
    assert plain.num_cached_tokens == 0
    assert a1.token_ids == b1.token_ids == a2.token_ids == plain.token_ids


def test_forced_hash_collisions_are_misses_not_wrong_kv(qwen3: HFCheckpoint) -> None:
    """With block hashes cut to 2 bits almost every lookup collides; hits are verified."""
    prompts = random_prompts(4000, [40, 40, 40], seed=15)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with cpu_llm(qwen3.path, debug_hash_bits=2) as llm:
        outs = [llm.generate([p], params)[0] for p in prompts]
        repeat = llm.generate([prompts[-1]], params)[0]
        stats = llm.engine.stats()
    assert stats["prefix_cache_collisions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == qwen3.greedy(prompt, 6)
    assert repeat.token_ids == outs[-1].token_ids
