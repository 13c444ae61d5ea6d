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

from engine import EngineConfig, LLMEngine

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
