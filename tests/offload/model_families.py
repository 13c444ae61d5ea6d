"""Small random checkpoints of other architectures than kvengine's Qwen3, for the vLLM model
family tests: written with transformers (``from_config`` + ``save_pretrained``), the tokenizer
copied from the ``small`` preset, head dim 32 (what vLLM's CPU attention accepts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_llama_checkpoint(out: Path, tokenizer_dir: Path, layer_types: list[str],
                           sliding_window: int | None, seed: int = 0) -> Path:
    """A Llama checkpoint with ``len(layer_types)`` layers, ``"sliding_attention"`` layers
    looking back ``sliding_window`` tokens (vLLM's Llama reads ``layer_types``, as Gemma's and
    gpt-oss's mixed layers); the vocabulary of ``tokenizer_dir``'s checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"], hidden_size=128, intermediate_size=256,
        num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=8192, rope_theta=10000.0,
        tie_word_embeddings=False, sliding_window=sliding_window, layer_types=layer_types,
        bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
