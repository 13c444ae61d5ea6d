"""benchmarks.router_overhead: a scaled-down run end to end on CPU (a real daemon, two real
`kvengine serve`, a real `kvengine router`). No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import router_overhead

pytestmark = pytest.mark.timeout(240)


def test_a_two_engine_node_is_measured_both_ways_on_cpu(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    reps = 2
    assert router_overhead.main([
        "--model-dir", str(tiny_model_dir), "--device", "cpu", "--sizes", "48,400",
        "--prompts-per-size", "1", "--reps", str(reps), "--gap-ms", "0", "--out",
        str(tmp_path), "--tag", "smoke"]) == 0
    result = json.loads(next(tmp_path.glob("router-overhead-smoke-*.json")).read_text())
    assert set(result["sizes"]) == {"48", "400"}
    for size in result["sizes"].values():
        assert size["num_errors"] == 0
        assert set(size["engines"].values()) <= set(result["engine_urls"])
        ttft = size["ttft_ms"]
        assert ttft["direct"]["n"] == 2 * reps  # a chat and a completion, each reps times
        assert ttft["routed"]["n"] + size["num_routed_elsewhere"] == 2 * reps
        assert ttft["hop"]["n"] == 2 * reps  # through a bare router in front of that engine
        assert ttft["hop_added_p50_ms"] is not None and ttft["routing_added_p50_ms"] is not None
        assert sum(size["router"]["requests_by_reason"].values()) == 2 * reps
        assert size["router"]["route_count"] == 2 * reps
        assert size["min_hbm_share"] == 1.0  # both ways were whole HBM hits
    assert result["target_met"].keys() == {"48", "400"}
