"""``kvengine make-model``: loadable by us and by transformers, deterministic, sharded, presets."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import HFCheckpoint, random_prompts, run_forward

from engine import EngineConfig, LLMEngine
from engine import make_model as mm


def test_tiny_checkpoint_files_and_hf_parity(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tiny_model_dir / name).is_file()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] % 64 == 0
    hf = HFCheckpoint(tiny_model_dir, AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32).eval())
    prompt = random_prompts(4000, [33], seed=1)[0]
    with LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=8)) as engine:
        assert engine.tokenizer.vocab_size <= config["vocab_size"]
        ours = run_forward(engine, prompt, 0, [4, 0, 6])
    np.testing.assert_allclose(ours, hf.logits(prompt), atol=1e-5, rtol=1e-4)


def test_cli_writes_deterministically_and_refuses_to_overwrite(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "engine.make_model", "--preset", "tiny", "--seed", "3"]
    first = subprocess.run(cmd + ["--out", str(tmp_path / "a")], capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr
    assert mm.main(["--preset", "tiny", "--seed", "3", "--out", str(tmp_path / "b")]) == 0
    assert mm.main(["--preset", "tiny", "--seed", "4", "--out", str(tmp_path / "c")]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert ((tmp_path / "a" / "model.safetensors").read_bytes()
            != (tmp_path / "c" / "model.safetensors").read_bytes())
    again = subprocess.run(cmd + ["--out", str(tmp_path / "a")], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr


def test_sharded_checkpoint_loads_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    mm.write_checkpoint(tmp_path / "one", "tiny", seed=8)
    monkeypatch.setattr(mm, "MAX_SHARD_BYTES", 300_000)
    mm.write_checkpoint(tmp_path / "many", "tiny", seed=8)
    shards = sorted((tmp_path / "many").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0].name.endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    prompt = random_prompts(4000, [20], seed=2)[0]
    logits = []
    for name in ("one", "many"):
        with LLMEngine(EngineConfig(str(tmp_path / name), device="cpu", num_kv_blocks=4)) as e:
            logits.append(run_forward(e, prompt, 0, [1, 2]))
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.parametrize(("preset", "low", "high"), [("qwen3-0.6b", 0.55e9, 0.65e9),
                                                     ("qwen3-4b", 3.9e9, 4.1e9)])
def test_big_presets_have_the_real_shapes(preset: str, low: float, high: float) -> None:
    config = mm.model_config(preset, 151936, "bfloat16", [1, 0])
    specs = mm.tensor_specs(config, "bfloat16")
    num_params = sum(math.prod(s.shape) for s in specs)
    assert low < num_params < high
    assert all(s.dtype == "bfloat16" for s in specs)
    assert "lm_head.weight" not in {s.name for s in specs}  # tied, as the real ones
    shards = mm.plan_shards(specs, mm.MAX_SHARD_BYTES)
    assert all(sum(s.nbytes for s in shard) <= mm.MAX_SHARD_BYTES for shard in shards)


def test_bf16_rounding_is_to_nearest_even() -> None:
    from engine.safetensors_writer import float32_to_bf16_bits

    x = np.array([1.0, 1.00390625, 1.01171875, 1.0 + 2**-9, -3.5], dtype=np.float32)
    bits = float32_to_bf16_bits(x)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(back, [1.0, 1.0, 1.015625, 1.0, -3.5])


def test_shipped_corpus_is_what_the_generator_writes(tmp_path: Path) -> None:
    data = Path(mm.__file__).parent / "data"
    total = sum(p.stat().st_size for p in data.glob("*.txt"))
    assert total > 300_000
    spec = importlib.util.spec_from_file_location("make_corpus", data / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import random

    rng = random.Random(20260301)
    assert module.stories(rng, 700) == (data / "stories.txt").read_text()


def test_progress_bar_on_a_terminal_only(tmp_path, capsys) -> None:
    """make-model's bytes-written bar: shown when asked, absent when stderr is a pipe."""
    mm.write_checkpoint(tmp_path / "shown", "tiny", seed=0, progress=True)
    err = capsys.readouterr().err
    assert "writing tiny weights" in err and "100%" in err
    out = subprocess.run([sys.executable, "-m", "engine.make_model", "--preset", "tiny",
                          "--out", str(tmp_path / "piped")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr and "writing tiny weights" not in out.stderr
