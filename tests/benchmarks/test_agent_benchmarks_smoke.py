"""The agent preset (benchmarks.multiturn.presets --preset agent-tools) scaled down end to end on
CPU (a real daemon, real `kvengine serve`), and benchmarks.structured_step on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import structured_step
from benchmarks.multiturn import presets

pytestmark = pytest.mark.timeout(180)


def test_agent_preset_has_the_issue_shape() -> None:
    preset = presets.PRESETS["agent-tools"]
    wl = preset["workload"]
    assert wl.agentic and wl.num_rounds >= 20 and wl.answer_len <= 32  # many short tool turns
    assert wl.system_prompt_len >= 4000  # the tool schemas
    assert wl.num_users >= 16 and preset["pressure_factor"] == 3.0
    assert wl.tool_result_len < wl.system_prompt_len // 10


def test_agent_preset_runs_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    code = presets.main(["--preset", "agent-tools", "--model-dir", str(tiny_model_dir),
                         "--device", "cpu", "--scale", "0.05", "--users", "2", "--rounds", "3",
                         "--qps", "50", "--no-progress", "--start-timeout", "60",
                         "--request-timeout", "60", "--out", str(tmp_path), "--tag", "smoke"])
    assert code == 0
    [path] = tmp_path.glob("multiturn-agent-tools-smoke-*.json")
    result = json.loads(path.read_text())
    assert [(p["offload"], p["error"]) for p in result["points"]] == [(True, None),
                                                                      (False, None)]
    for point in result["points"]:
        assert point["figures"]["num_ok"] == 6
        assert point["figures"]["ttft_ms"]["mean_later_turns"] > 0
        # which attention ran is on record (a GPU run without cuDNN shows here, not only in logs)
        assert point["attention_backend"] == "prefill=reference decode=reference"
    assert result["points"][0]["figures"]["hits"]["hit_rate"] > 0  # the loop's prefix reused


def test_structured_step_runs_on_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert structured_step.main(["--model", str(tiny_model_dir), "--preset", "tiny",
                                 "--device", "cpu", "--batch", "4", "--context", "32",
                                 "--steps", "3", "--warmup", "1", "--reps", "1",
                                 "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("structured_step-tiny-cpu-*.json")
    result = json.loads(path.read_text())
    assert set(result["step_ms"]) == {"free", "one_json", "all_json"}
    assert all(v["median"] > 0 for v in result["step_ms"].values())
    assert result["ratio_one_json"] > 0 and result["target_ratio_one_json"] == 1.1
