"""/metrics: Prometheus text with request, token, latency, prefix-cache and KV-block metrics."""

from __future__ import annotations

import random

import httpx
from server_helpers import METRICS_KEY, metric_value

OPERATOR = {"Authorization": f"Bearer {METRICS_KEY}"}

NAMES = [
    "kvengine:request_success_total",
    "kvengine:prompt_tokens_total",
    "kvengine:generation_tokens_total",
    "kvengine:time_to_first_token_seconds_bucket",
    "kvengine:inter_token_latency_seconds_count",
    "kvengine:e2e_request_latency_seconds_count",
    "kvengine:prefix_cache_queries_total",
    "kvengine:prefix_cache_hits_total",
    "kvengine:kv_blocks_in_use",
    "kvengine:kv_blocks_total",
    "kvengine:num_requests_running",
    "kvengine:num_requests_waiting",
]


def test_metrics_count_what_was_served(http: httpx.Client) -> None:
    before = http.get("/metrics", headers=OPERATOR)
    assert before.status_code == 200
    assert before.headers["content-type"].startswith("text/plain")
    for name in NAMES:
        assert name in before.text, name
    rng = random.Random(99)
    prompt = [rng.randrange(3, 200) for _ in range(70)]
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    for _ in range(2):  # the second run hits the HBM prefix cache
        assert http.post("/v1/completions", json=body).status_code == 200
    after = http.get("/metrics", headers=OPERATOR).text

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before.text, name, **labels)

    assert delta("kvengine:request_success_total", finished_reason="length") == 2
    assert delta("kvengine:prompt_tokens_total") == 140
    assert delta("kvengine:generation_tokens_total") == 10
    assert delta("kvengine:time_to_first_token_seconds_count") == 2
    assert delta("kvengine:inter_token_latency_seconds_count") == 8
    assert delta("kvengine:prefix_cache_queries_total") == 140
    assert delta("kvengine:prefix_cache_hits_total", tier="hbm") >= 48
    assert metric_value(after, "kvengine:kv_blocks_total") > 0
