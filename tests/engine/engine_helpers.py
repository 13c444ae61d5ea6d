"""Helpers of the engine tests: HF reference checkpoints and random prompts."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine import LLMEngine
from engine.models.decoder import ForwardBatch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# Large enough init that logits are well separated: greedy parity is not decided by rounding.
SMALL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=512, initializer_range=0.25)


@dataclass
class HFCheckpoint:
    """A checkpoint folder and the transformers model it was saved from (float32, eval mode)."""

    path: Path
    model: object

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """HF logits ``[len(token_ids), V]`` for one sequence, no cache."""
        import torch

        with torch.no_grad():
            out = self.model(torch.tensor([token_ids], dtype=torch.long))
        return out.logits[0].float().numpy()

    def greedy(self, token_ids: list[int], num_new_tokens: int) -> list[int]:
        """HF greedy continuation, recomputing the full sequence every step."""
        ids = list(token_ids)
        for _ in range(num_new_tokens):
            ids.append(int(np.argmax(self.logits(ids)[-1])))
        return ids[len(token_ids):]


def build_hf_checkpoint(
    out: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides: object
) -> HFCheckpoint:
    """Save a random ``arch`` model ("qwen3", "llama", "qwen2") with transformers, float32."""
    import torch
    import transformers

    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    # Tiny models: torch's thread pool only fights NumPy's BLAS threads on a busy 2-core box.
    torch.set_num_threads(1)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    kwargs = {**SMALL_SHAPE, "vocab_size": vocab, **overrides}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # norms at 1.0 would hide a missing or misplaced norm weight
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return HFCheckpoint(out, model)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, avoiding the special ids 0..2 (eos among them)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, n).tolist() for n in lengths]


def run_forward(engine: LLMEngine, token_ids: list[int], start: int, block_ids: list[int]
                ) -> np.ndarray:
    """Logits of every position in ``token_ids[start:]``, the prefix read from the blocks."""
    bs = engine.config.block_size
    positions = np.arange(start, len(token_ids), dtype=np.int32)
    blocks = np.array(block_ids, dtype=np.int32)
    dev = engine.runner.ops.to_device  # the identity on CPU
    batch = ForwardBatch(
        token_ids=dev(np.array(token_ids[start:], dtype=np.int32)), positions=dev(positions),
        slot_mapping=dev((blocks[positions // bs] * bs + positions % bs).astype(np.int32)),
        block_tables=dev(blocks[None, :]),
        cu_seqlens_q=dev(np.array([0, len(positions)], np.int32)),
        context_lens=dev(np.array([len(token_ids)], np.int32)),
        logits_indices=dev(np.arange(len(positions), dtype=np.int32)), is_decode=False,
        max_query_len=len(positions), max_context_len=len(token_ids),
    )
    return engine.runner.forward(batch)
