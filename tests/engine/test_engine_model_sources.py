"""What a moved vLLM setup brings to the engine: sharded checkpoints with an index,
generation_config sampling defaults, --seed, --dtype."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.generation_config import sampling_defaults
from engine.safetensors_writer import SafetensorsWriter, TensorSpec
from engine.weights import INDEX_FILE, CheckpointReader, weights_identity

PROMPT = [5, 17, 42, 99, 3, 250, 7]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _reshard(source: Path, out: Path, stray_copy: bool = False) -> dict[str, str]:
    """`source`'s one-file checkpoint as two shards plus HF's index (and, if asked, a stray
    consolidated copy of every tensor, as some hub repos carry beside their shards)."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    reader = CheckpointReader(source)
    names = reader.names()
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    groups = [(files[0], halves[0]), (files[1], halves[1])]
    if stray_copy:
        groups.append(("consolidated.safetensors", names))
    for fname, group in groups:
        infos = [reader.info(name) for name in group]
        writer = SafetensorsWriter(out / fname, [TensorSpec(i.name, i.shape, i.dtype)
                                                 for i in infos])
        for info in infos:
            raw, _ = reader.read(info.name)
            writer.write(info.name, iter([raw.tobytes()]))
        writer.close()
    reader.close()
    weight_map = {name: fname for fname, group in groups[:2] for name in group}
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def _greedy(model_dir: Path) -> list[int]:
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=32)
    try:
        return llm.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        llm.close()


def test_an_indexed_sharded_checkpoint_loads_the_same(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    _reshard(tiny_model_dir, sharded, stray_copy=True)
    # The index names the model's files: the consolidated copy would be a duplicate otherwise.
    assert _greedy(sharded) == _greedy(tiny_model_dir)
    assert weights_identity(sharded) != weights_identity(tiny_model_dir)  # other files


def test_a_bad_index_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    weight_map = _reshard(tiny_model_dir, sharded)
    (sharded / "model-00002-of-00002.safetensors").rename(sharded / "elsewhere.bin")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        CheckpointReader(sharded)
    (sharded / "elsewhere.bin").rename(sharded / "model-00002-of-00002.safetensors")
    name = next(iter(weight_map))
    wrong = {**weight_map, name: "model-00002-of-00002.safetensors"}
    (sharded / INDEX_FILE).write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(ValueError, match=f"puts tensor '{name}' in model-00002"):
        CheckpointReader(sharded)
    (sharded / INDEX_FILE).write_text(json.dumps({"weight_map": {name: "../escape.safetensors"}}))
    with pytest.raises(ValueError, match="weight_map"):
        CheckpointReader(sharded)


def test_generation_config_sampling_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "repetition_penalty": 1.1, "max_new_tokens": 100, "eos_token_id": [1, 2]}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                           "repetition_penalty": 1.1, "max_tokens": 100}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        sampling_defaults(tmp_path)


def test_seed_seeds_requests_without_their_own(tiny_model_dir: Path) -> None:
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=32,
                                        seed=seed))
        try:
            for i in range(2):
                engine.add_request(f"r{i}", PROMPT, sampled)
            outs: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outs[out.request_id] = out.token_ids
            return [outs["r0"], outs["r1"]]
        finally:
            engine.close()

    first, again, other = run(7), run(7), run(8)
    assert first == again and first != other and first[0] != first[1]


@pytest.mark.parametrize(("dtype", "ok"), [("auto", True), ("float32", True), ("float", True),
                                           ("float16", False), ("bfloat16", False)])
def test_dtype_is_honoured_or_refused(tiny_model_dir: Path, dtype: str, ok: bool) -> None:
    config = EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=16, dtype=dtype)
    if ok:
        LLMEngine(config).close()
    else:
        with pytest.raises(ValueError, match="not supported on cpu: this backend computes in "
                                             "float32"):
            LLMEngine(config)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(str(tiny_model_dir), dtype="int8")
