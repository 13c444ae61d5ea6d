"""benchmarks.router_overhead: its arithmetic, and a scaled-down run end to end on CPU (a real
daemon, two real `kvengine serve`, a real `kvengine router`). No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import router_overhead

pytestmark = pytest.mark.timeout(240)


def test_quantiles_from_cumulative_buckets() -> None:
    buckets = [(0.001, 2.0), (0.002, 6.0), (0.005, 10.0), (float("inf"), 10.0)]
    assert router_overhead._bucket_quantile(buckets, 0.5) == pytest.approx(1.75)
    assert router_overhead._bucket_quantile(buckets, 0.1) == pytest.approx(0.5)
    assert router_overhead._bucket_quantile([(0.001, 0.0)], 0.5) is None


def test_metrics_deltas_name_every_reason_that_moved() -> None:
    before = {'kvengine:router_requests{reason="hbm_hit",engine="a"}': 3.0,
              "kvengine:router_route_seconds_sum": 0.5, "kvengine:router_route_seconds_count": 2}
    after = {'kvengine:router_requests{reason="hbm_hit",engine="a"}': 5.0,
             'kvengine:router_requests{reason="fallback",engine="b"}': 1.0,
             'kvengine:router_requests{reason="miss",engine="b"}': 0.0,
             "kvengine:router_route_seconds_sum": 0.503, "kvengine:router_route_seconds_count": 5}
    delta = router_overhead.metrics_delta(before, after)
    assert delta["requests_by_reason"] == {"hbm_hit": 2.0, "fallback": 1.0}
    assert delta["route_mean_ms"] == pytest.approx(1.0)
    assert delta["prompt_mean_ms"] is None


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
        assert sum(size["router"]["requests_by_reason"].values()) == 2 * reps
        assert size["router"]["route_count"] == 2 * reps
        assert size["min_hbm_share"] == 1.0  # both ways were whole HBM hits
    assert result["target_met"].keys() == {"48", "400"}
