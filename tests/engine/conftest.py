"""Tiny checkpoints for the engine tests: one from make-model, others built with HF transformers.

HF checkpoints are random models saved by ``save_pretrained`` in float32 with our make-model
tokenizer files copied in; the same torch module is kept as the reference to compare against.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import HFCheckpoint, build_hf_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoints(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> dict[str, HFCheckpoint]:
    """Qwen3 (untied and tied), Llama 3 with llama3 rope scaling, Qwen2 (q/k/v biases)."""
    root = tmp_path_factory.mktemp("hf")
    llama_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
    return {
        "qwen3": build_hf_checkpoint(root / "qwen3", tiny_model_dir, "qwen3", seed=1),
        "qwen3-tied": build_hf_checkpoint(root / "qwen3-tied", tiny_model_dir, "qwen3", seed=2,
                                          tie_word_embeddings=True),
        "llama": build_hf_checkpoint(root / "llama", tiny_model_dir, "llama", seed=3,
                                     rope_parameters=llama_rope),
        "qwen2": build_hf_checkpoint(root / "qwen2", tiny_model_dir, "qwen2", seed=4),
    }


@pytest.fixture(scope="session")
def qwen3(hf_checkpoints: dict[str, HFCheckpoint]) -> HFCheckpoint:
    return hf_checkpoints["qwen3"]
