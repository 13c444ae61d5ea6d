"""benchmarks.node: the issue's ratios from configurations' figures, and a scaled-down node end
to end on CPU (a real daemon, two real `kvengine serve`, a real `kvengine router`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import node

pytestmark = pytest.mark.timeout(240)


def _point(later_ms: float, later_p50_ms: float, others_ms: float = 500.0) -> dict:
    return {"error": None, "summary": {
        "later_ms": later_ms, "later_p50_ms": later_p50_ms, "all_ms": others_ms,
        "first_ms": others_ms, "p90_ms": others_ms, "p99_ms": others_ms}}


def test_ratios_follow_the_issue() -> None:
    ratios = node.compare({"rr-no-store": _point(800, 700), "rr-store": _point(200, 300, 600),
                           "kv": _point(100, 150, 400), "single": _point(80, 70)})
    assert ratios == {"kv_later_vs_single": 1.25, "kv_later_vs_rr_no_store": 8.0,
                      "kv_vs_rr_store_later_p50": 2.0, "rr_store_vs_rr_no_store_later": 4.0,
                      "kv_vs_rr_store_all": 1.5, "kv_vs_rr_store_first": 1.5,
                      "kv_vs_rr_store_p90": 1.5, "kv_vs_rr_store_p99": 1.5}
    assert set(ratios) == set(node.TARGETS)  # every ratio has its target
    failed = node.compare({"kv": {"error": "boom"}, "single": _point(80, 70)})
    assert failed["kv_later_vs_single"] is None


def test_a_two_engine_node_runs_end_to_end_on_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert node.main(["--model-dir", str(tiny_model_dir), "--device", "cpu", "--gpus", "2",
                      "--scale", "0.02", "--users", "3", "--qps", "6", "--duration-s", "3",
                      "--configs", "kv,single",
                      "--no-progress", "--out", str(tmp_path), "--tag", "smoke"]) == 0
    result = json.loads(next(tmp_path.glob("node-smoke-*.json")).read_text())
    kv, single = result["points"]["kv"], result["points"]["single"]
    assert kv["error"] is None and single["error"] is None, (kv["error"], single["error"])
    assert kv["engines"] == 2 and single["engines"] == 1
    assert kv["summary"]["num_ok"] == kv["summary"]["num_requests"] > 0
    routed = kv["router_requests_by_reason"]
    assert sum(routed.values()) >= kv["summary"]["num_requests"]  # warm-ups go direct
    assert result["ratios"]["kv_later_vs_single"] is not None
    stages = kv["routing_stages_ms"]  # each decision's stages, first turns and later apart
    assert sum(g["locate"]["n"] for g in stages.values()) == len(kv["routes"]) > 0
    assert all(g["prompt"]["max"] >= g["prompt"]["p50"] > 0 for g in stages.values())
    # the configurations of one file (or of several) join into one result, chosen by name
    path = next(tmp_path.glob("node-smoke-*.json"))
    merged_dir = tmp_path / "merged"
    assert node.main(["--merge", f"{path}:kv", f"{path}:single", "--tag", "m",
                      "--out", str(merged_dir)]) == 0
    merged = json.loads(next(merged_dir.glob("node-m-*.json")).read_text())
    assert set(merged["points"]) == {"kv", "single"}
    assert merged["ratios"] == result["ratios"]
    with pytest.raises(SystemExit, match="no configuration rr-store"):
        node.main(["--merge", f"{path}:rr-store", "--out", str(merged_dir)])
    with pytest.raises(SystemExit, match="configuration kv is in two files"):
        node.main(["--merge", str(path), f"{path}:kv", "--out", str(merged_dir)])


@pytest.mark.parametrize("argv", [["--configs", "kv,bogus"], ["--gpus", "0"]])
def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path, argv) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        node.main(["--model-dir", str(tmp_path), "--device", "cpu", *argv])
    assert exc.value.code == 2
