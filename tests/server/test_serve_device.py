"""`kvengine serve --device auto|cpu|cuda|cuda:N`: checked when parsed, a GPU that is not there
refused at start with one line, and (marker gpu, two GPUs) an engine on cuda:1 that allocates,
steps from another thread and registers there."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from support.kvengine import run_kvengine

from engine import LLM, EngineConfig, SamplingParams
from engine.config import cuda_index


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:12"])
def test_devices_accepted(device: str, tiny_model_dir: Path) -> None:
    assert EngineConfig(model_dir=str(tiny_model_dir), device=device).device == device


@pytest.mark.parametrize("device", ["tpu", "cuda:", "cuda:-1", "cuda:01", "cuda:1:0", "CUDA:0",
                                    " cuda:0", "cuda:x", 0])
def test_devices_refused(device, tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cuda:N"):
        EngineConfig(model_dir=str(tiny_model_dir), device=device)


def test_cuda_index() -> None:
    assert [cuda_index(d) for d in ("cuda:0", "cuda:3", "cuda", "cpu", "auto")] == \
        [0, 3, None, None, None]


def test_the_flag_is_checked_and_a_missing_gpu_refused(tiny_model_dir: Path) -> None:
    bad = run_kvengine(["serve", str(tiny_model_dir), "--device", "cuda:one"])
    assert bad.returncode == 2 and "--device" in bad.stderr and "cuda:N" in bad.stderr
    missing = run_kvengine(["serve", str(tiny_model_dir), "--device", "cuda:999",
                            "--port", "0", "--no-warm-up"])
    assert missing.returncode == 1, missing.stderr
    assert "cuda:999" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.gpu
def test_an_engine_on_the_second_gpu(tiny_model_dir: Path) -> None:
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [[(3 * i) % 500 + 7 for i in range(40)]]
    with LLM(str(tiny_model_dir), device="cuda:0", num_kv_blocks=64) as first:
        expected = first.generate(prompt, params)[0].token_ids
    with LLM(str(tiny_model_dir), device="cuda:1", num_kv_blocks=64) as second:
        engine = second.engine
        assert engine.device == "cuda"
        assert engine.kv_cache.layout().device == "cuda:1"
        assert engine.runner.kv_cache.array.device.id == 1
        got: list = []
        # The serving loop steps on a thread of its own, whose current device starts at 0.
        stepper = threading.Thread(target=lambda: got.append(second.generate(prompt, params)))
        stepper.start()
        stepper.join(120)
        assert got and got[0][0].token_ids == expected
