"""Engine logits against HF float32 at long prompts (skipped without a GPU), the attention the
CUDA backend picks included (cuDNN where available): relative error <= 0.05 (issue 17).

A Qwen3-shaped model with Qwen3-4B's attention geometry per KV group (head_dim 128, 4 query heads
per KV head), 6k positions. Three quarters of each prompt are prefilled first; the rest runs as a
second step over that cached prefix, so the prefix read and the bottom-right causal mask count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_helpers import HFCheckpoint, build_hf_checkpoint, random_prompts, run_forward

from engine import LLM, EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu

MAX_POSITIONS = 8192


@pytest.fixture(scope="module")
def long_qwen3(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> HFCheckpoint:
    return build_hf_checkpoint(tmp_path_factory.mktemp("long") / "qwen3", tiny_model_dir, "qwen3",
                               seed=5, hidden_size=128, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=128,
                               max_position_embeddings=MAX_POSITIONS, initializer_range=0.1)


@pytest.mark.parametrize("length", [16, 1000, 6000])
def test_long_prompt_logits_close_to_hf_float32(long_qwen3: HFCheckpoint, length: int) -> None:
    prompt = random_prompts(4000, [length], seed=length)[0]
    config = EngineConfig(str(long_qwen3.path), device="cuda",
                          num_kv_blocks=MAX_POSITIONS // 16 + 8)
    with LLMEngine(config) as engine:
        ops = engine.runner.ops
        blocks = list(range(1, -(-length // engine.config.block_size) + 1))
        split = length * 3 // 4
        first = ops.to_host(run_forward(engine, prompt[:split], 0, blocks))
        rest = ops.to_host(run_forward(engine, prompt, split, blocks))
        backends, fallbacks = dict(ops.attention_backends), ops.num_attention_fallbacks
    ours = np.concatenate([first, rest]).astype(np.float32)
    want = long_qwen3.logits(prompt)
    rel = float(np.linalg.norm(ours - want) / np.linalg.norm(want))
    print(f"{length} tokens: relative error {rel:.4f}, {backends}, {fallbacks} fallbacks")
    assert rel <= 0.05, f"relative error {rel:.4f} at {length} tokens ({backends})"
    if backends["prefill"] == "cudnn":  # cuDNN served every call, none fell back
        assert fallbacks == 0


def test_short_turn_over_long_prefix_logits_close_to_hf_float32(long_qwen3: HFCheckpoint
                                                               ) -> None:
    """A chat turn's last 40 tokens over 5,960 cached ones: the split attention (cuDNN
    slices + tail + merge) where cuDNN runs, within the same bound of HF float32."""
    length, new = 6000, 40
    prompt = random_prompts(4000, [length], seed=7)[0]
    config = EngineConfig(str(long_qwen3.path), device="cuda",
                          num_kv_blocks=MAX_POSITIONS // 16 + 8)
    with LLMEngine(config) as engine:
        ops = engine.runner.ops
        blocks = list(range(1, -(-length // engine.config.block_size) + 1))
        run_forward(engine, prompt[:length - new], 0, blocks)
        rest = ops.to_host(run_forward(engine, prompt, length - new, blocks))
        cudnn = getattr(ops, "_cudnn", None)
        split_calls = cudnn.calls.get(("split",), 0) if cudnn is not None else 0
        backends = dict(ops.attention_backends)
    want = long_qwen3.logits(prompt)[length - new:]
    rel = float(np.linalg.norm(rest.astype(np.float32) - want) / np.linalg.norm(want))
    print(f"{new} tokens over {length - new}: relative error {rel:.4f}, {backends}, "
          f"{split_calls} split calls")
    assert rel <= 0.05
    if backends["prefill"] == "cudnn":
        assert split_calls == engine.model_config.num_layers


def test_prefill_graphs_give_the_eager_tokens(long_qwen3: HFCheckpoint) -> None:
    """HBM-hit turns (a few dozen new tokens over a cached 3,000) replayed from prefill graphs
    (one and two sequences, padded rows) pick the tokens the eager steps pick."""
    history = random_prompts(4000, [3000, 2200], seed=8)
    turns = [h + t for h, t in zip(history, random_prompts(4000, [37, 5], seed=9))]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    results = {}
    for eager in (True, False):
        with LLM(str(long_qwen3.path), device="cuda", enforce_eager=eager,
                 num_kv_blocks=MAX_POSITIONS // 16 + 8) as llm:
            llm.generate(history, greedy)
            outs = llm.generate(turns[:1], greedy) + llm.generate(turns, greedy)
            graphs = llm.engine.runner.prefill_graphs
            results[eager] = [o.token_ids for o in outs]
            assert all(o.num_cached_tokens >= 2000 for o in outs)
            if not eager:
                assert graphs.num_captures >= 1 and graphs.num_replays >= 2
    assert results[False] == results[True]


def test_turns_after_the_warm_up_give_the_eager_tokens(long_qwen3: HFCheckpoint) -> None:
    """One user's turns after ``warm_up`` (every prefill bucket captured before the first decode
    graph): each turn replays a prefill graph, then decode graphs of one row. Whatever the decode
    graphs read across replays must not sit in a prefill graph's scratch (the cuDNN decode's
    query lengths once did), so the tokens equal the eager engine's."""
    history = random_prompts(4000, [3000], seed=10)[0]
    extras = random_prompts(4000, [30, 21, 12], seed=11)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    results = {}
    for eager in (True, False):
        with LLM(str(long_qwen3.path), device="cuda", enforce_eager=eager,
                 num_kv_blocks=MAX_POSITIONS // 16 + 8) as llm:
            runner = llm.engine.runner
            assert llm.engine.warm_up() == (0 if eager else
                                            len(runner.prefill_graphs.warm_buckets())
                                            + len(runner.decode_graphs.warm_buckets()))
            prompt, tokens = list(history), []
            for extra in extras:
                out = llm.generate([prompt], greedy)[0]
                tokens.append(out.token_ids)
                prompt = prompt + out.token_ids + extra
            results[eager] = tokens
    assert results[False] == results[True]
