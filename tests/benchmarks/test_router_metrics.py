"""benchmarks.router_metrics: histogram quantiles from cumulative buckets, and what moved between
two scrapes of the router's /metrics."""

from __future__ import annotations

import pytest

from benchmarks.router_metrics import bucket_quantile, metrics_delta


def test_quantiles_from_cumulative_buckets() -> None:
    buckets = [(0.001, 2.0), (0.002, 6.0), (0.005, 10.0), (float("inf"), 10.0)]
    assert bucket_quantile(buckets, 0.5) == pytest.approx(1.75)
    assert bucket_quantile(buckets, 0.1) == pytest.approx(0.5)
    assert bucket_quantile([(0.001, 0.0)], 0.5) is None


def test_metrics_deltas_name_every_reason_that_moved() -> None:
    before = {'kvengine:router_requests{reason="hbm_hit",engine="a"}': 3.0,
              "kvengine:router_route_seconds_sum": 0.5, "kvengine:router_route_seconds_count": 2}
    after = {'kvengine:router_requests{reason="hbm_hit",engine="a"}': 5.0,
             'kvengine:router_requests{reason="fallback",engine="b"}': 1.0,
             'kvengine:router_requests{reason="miss",engine="b"}': 0.0,
             "kvengine:router_route_seconds_sum": 0.503, "kvengine:router_route_seconds_count": 5}
    delta = metrics_delta(before, after)
    assert delta["requests_by_reason"] == {"hbm_hit": 2.0, "fallback": 1.0}
    assert delta["route_mean_ms"] == pytest.approx(1.0)
    assert delta["prompt_mean_ms"] is None
