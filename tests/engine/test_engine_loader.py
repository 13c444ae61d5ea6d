"""Loading HF folders: config forms, rope scaling, bf16 weights, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import HFCheckpoint, random_prompts, run_forward

from engine import EngineConfig, LLMEngine
from engine.make_model import write_checkpoint
from engine.model_config import ModelConfig, RopeConfig, UnsupportedModelError
from engine.models.rope import inverse_frequencies
from engine.weights import CheckpointReader, weights_identity

BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128}


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_both_rope_forms_parse_the_same() -> None:
    old = ModelConfig.from_dict({**BASE, "rope_theta": 1e6, "rope_scaling": None})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 1e6,
                                                             "rope_type": "default"}})
    assert old.rope == new.rope == RopeConfig(theta=1e6)
    assert ModelConfig.from_dict(BASE).rope.theta == 10000.0


def test_llama3_rope_scaling_both_forms_and_hf_frequencies() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    llama = {**BASE, "architectures": ["LlamaForCausalLM"], "head_dim": 64}
    old = ModelConfig.from_dict({**llama, "rope_theta": 500000.0, "rope_scaling": scaling})
    new = ModelConfig.from_dict({**llama, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old.rope == new.rope and old.rope.rope_type == "llama3"
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                            rope_parameters={**scaling, "rope_theta": 500000.0})
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = inverse_frequencies(new.rope, 64)
    np.testing.assert_allclose(ours, hf_inv_freq.numpy(), rtol=1e-6)
    assert not np.allclose(ours, inverse_frequencies(RopeConfig(500000.0), 64))


def test_qwen2_has_qkv_bias_and_llama_follows_flags() -> None:
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    llama = ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                                   "attention_bias": True, "mlp_bias": True})
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias
    assert ModelConfig.from_dict(BASE).qk_norm


@pytest.mark.parametrize("changes", [
    {"architectures": ["MistralForCausalLM"]},
    {"architectures": []},
    {"use_sliding_window": True},
    {"layer_types": ["full_attention", "sliding_attention"]},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
    {"hidden_act": "gelu"},
])
def test_unsupported_configs_are_refused(changes: dict) -> None:
    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_dict({**BASE, **changes})


def test_malformed_configs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.from_dict({**BASE, "num_key_value_heads": 3})


def test_unsupported_architecture_error_from_the_engine(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: Qwen3"):
        LLMEngine(EngineConfig(str(folder), device="cpu"))


@pytest.mark.parametrize(("missing", "message"), [
    ("config.json", "no config.json"),
    ("tokenizer.json", "no tokenizer.json"),
    ("model.safetensors", r"no \*.safetensors"),
])
def test_missing_files_are_named(tiny_model_dir: Path, tmp_path: Path, missing: str,
                                 message: str) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=message):
        LLMEngine(EngineConfig(str(folder), device="cpu"))


def test_missing_folder_and_missing_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(EngineConfig(str(tmp_path / "nope"), device="cpu"))
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    edit_config(folder, num_hidden_layers=3)
    with pytest.raises(KeyError, match=r"model\.layers\.2\."):
        LLMEngine(EngineConfig(str(folder), device="cpu"))


def test_corrupt_safetensors_header_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length"):
        CheckpointReader(tmp_path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="bad data offsets"):
        CheckpointReader(tmp_path)


def test_bf16_checkpoint_matches_hf(tmp_path: Path) -> None:
    """make-model in bf16: our widening reader and the model agree with transformers' loader."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "bf16"
    write_checkpoint(folder, "tiny", seed=5, dtype="bfloat16")
    reader = CheckpointReader(folder)
    torch_tensors = load_file(str(folder / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        raw, dtype = reader.read(name)
        assert dtype == "bfloat16" and raw.dtype == np.uint16
        widened = (raw.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(widened, torch_tensors[name].float().numpy())
    hf = HFCheckpoint(folder, AutoModelForCausalLM.from_pretrained(folder,
                                                                   dtype=torch.float32).eval())
    prompt = random_prompts(4000, [20], seed=1)[0]
    with LLMEngine(EngineConfig(str(folder), device="cpu", num_kv_blocks=8)) as engine:
        ours = run_forward(engine, prompt, 0, [3, 1])
    np.testing.assert_allclose(ours, hf.logits(prompt), atol=1e-4, rtol=1e-4)


def test_weights_identity_tracks_config_and_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    assert weights_identity(folder) == weights_identity(tiny_model_dir)
    edit_config(folder, rms_norm_eps=1e-5)
    assert weights_identity(folder) != weights_identity(tiny_model_dir)
