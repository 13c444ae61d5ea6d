"""benchmarks.faults.soak for about 20 s on CPU: a real `kvstore serve` and `kvengine serve
--kv-offload` (tiny model) under the long-context preset, scaled down, while each kind of fault
strikes once; every answer checked against a reference engine without offload. Then the verdict
of that real run, judged again with one thing changed (an answer, a failure, memory left
behind), must turn. Bad arguments are refused before anything starts."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks.faults import soak as fault_soak
from benchmarks.faults.verdict import verdict

pytestmark = pytest.mark.timeout(150)

SMOKE = ["--device", "cpu", "--scale", "0.03", "--users", "4", "--qps", "6",
         "--minutes", "0.35", "--fault-every", "4.5", "--first-fault-s", "2", "--tail-s", "3",
         "--stop-s", "2.5", "--settle-s", "1", "--seed", "1", "--machine", "smoke"]
KINDS = {"daemon-stop", "daemon-kill", "engine-term", "engine-kill"}


@pytest.fixture(scope="module")
def soak(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    out = tmp_path_factory.mktemp("fault-soak")
    rc = fault_soak.main(["--model-dir", str(tiny_model_dir), *SMOKE, "--out", str(out)])
    [path] = out.glob("fault-soak-smoke-*.json")
    return rc, json.loads(path.read_text())


def judge(result: dict) -> dict:
    """The verdict of ``result`` as the benchmark judges it."""
    config = result["config"]
    return verdict(result["records"], result["schedule"], result["outcomes"],
                   result["memory_before"], result["memory_after"],
                   config["memory_tolerance"], config["memory_slack_bytes"])


def test_a_short_soak_under_every_fault_passes(soak) -> None:
    rc, result = soak
    v = result["verdict"]
    assert rc == 0 and v["passed"], (v["checks"], v["failures"], result["outcomes"])
    assert {"machine", "date", "command", "schedule", "records"} <= set(result)
    assert {o["kind"] for o in result["outcomes"]} == KINDS
    assert all(o["error"] is None for o in result["outcomes"])
    assert result["incarnations"] == {"daemon": 2, "engine": 3}
    assert v["requests"] >= 20 and v["answers"]["compared"] == v["answers"]["answered"]
    assert v["restored_tokens_from_store"] > 0
    # the engines each request went to: all three incarnations served
    assert {r["engine"] for r in result["records"]} == {1, 2, 3}
    stop = next(o for o in result["outcomes"] if o["kind"] == "daemon-stop")
    assert stop["store_flagged_after_s"] is not None  # the engine saw the hang
    assert {i["what"] for i in v["memory"]["items"]} >= {
        "daemon anon_bytes", "engine anon_bytes", "daemon engine_arena_bytes"}
    assert judge(result) == v  # the file holds all the verdict needs
    # the reference measured against itself first: a sample of the answers (at most 96) asked
    # again, one at a time; the margin used is the stated one or what its own differences
    # needed, if larger; a scorer with a prefix cache scores, apart from the reference
    calibration = result["calibration"]
    assert calibration["asked"] == min(96, v["answers"]["compared"])
    assert calibration["errors"] == 0
    assert "--no-enable-prefix-caching" in result["reference"]["command"]
    assert "--no-enable-prefix-caching" not in result["reference"]["scorer_command"]
    assert result["numerics_margin_used"] == max(result["config"]["numerics_margin"],
                                                 calibration["largest_share"])


def test_a_different_answer_fails_the_verdict(soak) -> None:
    _, result = soak
    changed = copy.deepcopy(result)
    record = next(r for r in changed["records"] if r["error"] is None)
    record["answer"] += " and one more word"
    v = judge(changed)
    assert not v["passed"] and not v["checks"]["differences_only_numerics"]
    assert v["answers"]["differences"] == v["answers"]["unexplained"] == [record["index"]]
    # scored by the reference: within its margin it is numerics, beyond it wrong
    record["numerics"] = {"within": True, "largest_margin": 0.01, "median_spread": 3.0}
    assert judge(changed)["passed"]
    record["numerics"] = {"within": False, "largest_margin": 7.5, "median_spread": 3.0}
    assert not judge(changed)["checks"]["differences_only_numerics"]
    record["reference"] = None  # the reference did not answer it: not compared, not passed
    assert not judge(changed)["checks"]["every_answer_compared"]


def test_only_requests_in_flight_at_an_engine_stop_may_fail(soak) -> None:
    _, result = soak
    changed = copy.deepcopy(result)
    record = next(r for r in changed["records"] if r["error"] is None)
    record.update(error="ConnectError: refused", reference=None)
    assert not judge(changed)["checks"]["no_failures_but_in_flight_at_engine_stops"]
    by_kind = {f["kind"]: f["index"] for f in changed["schedule"]}
    record["in_flight_at_fault"] = by_kind["daemon-kill"]  # the engine stayed up: no excuse
    assert not judge(changed)["checks"]["no_failures_but_in_flight_at_engine_stops"]
    record["in_flight_at_fault"] = by_kind["engine-kill"]
    assert judge(changed)["passed"]


def test_memory_left_behind_fails_the_verdict(soak) -> None:
    _, result = soak
    changed = copy.deepcopy(result)
    daemon = changed["memory_after"]["processes"]["daemon"]
    daemon["engine_arena_bytes"] *= 2  # it still maps a dead engine's arena
    assert not judge(changed)["checks"]["memory_back_to_baseline"]
    changed = copy.deepcopy(result)
    changed["memory_after"]["processes"]["engine"]["anon_bytes"] += 2**30
    assert not judge(changed)["checks"]["memory_back_to_baseline"]


@pytest.mark.parametrize("args, message", [
    (["--scale", "2"], "--scale must be in (0, 1]"),
    (["--scale", "1"], "lower --scale"),  # the preset's 20k tokens do not fit the tiny model
    (["--faults", "daemon-stop,reboot"], "unknown fault kind(s) reboot"),
    (["--minutes", "1", "--fault-every", "30"], "room for 1 fault(s)"),
    (["--device", "tpu"], "cpu, cuda or cuda:N"),
    (["--qps", "0"], "must be positive"),
])
def test_bad_arguments_are_refused(tiny_model_dir: Path, capsys, args: list[str],
                                   message: str) -> None:
    base = ["--model-dir", str(tiny_model_dir), "--device", "cpu", "--scale", "0.03"]
    with pytest.raises(SystemExit) as exit_info:
        fault_soak.main([*base, *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_folder_without_a_model_is_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        fault_soak.main(["--model-dir", str(tmp_path), "--device", "cpu"])
    assert "no config.json" in capsys.readouterr().err
