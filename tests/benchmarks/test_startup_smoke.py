"""benchmarks.startup on the CPU: real starts of `kvengine serve`, timed to ready, after
``--compile-bytecode`` compiled the folder of every module the server imports (what a
``pip install`` leaves and an image without bytecode lacks)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import startup


def test_starts_are_timed_after_the_servers_modules_are_compiled(tmp_path: Path) -> None:
    assert startup.main(["--preset", "tiny", "--device", "cpu", "--reps", "2",
                         "--compile-bytecode", "--timeout", "120", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("startup-*-cpu-*.json")
    report = json.loads(path.read_text())
    compiled = report["compiled_before_the_runs"]
    assert compiled["folders"] > 10 and compiled["compiled"] == compiled["folders"]
    state = report["bytecode"]
    assert state["server_cli_compiled"] and state["fastapi_compiled"] and state["numpy_compiled"]
    assert len(report["runs"]) == 2 and report["warm"]["ready_s_median"] > 0
    assert all(run["ready_s"] <= run["first_token_s"] for run in report["runs"])
