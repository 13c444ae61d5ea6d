"""/metrics: Prometheus text with request, token, latency, prefix-cache and KV-block metrics."""

from __future__ import annotations

import random
import re

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
    "kvengine:num_preemptions_total",
    "kvengine:cache_config_info{",
    "kvengine:attention_backend_info{",
    "kvengine:attention_fallbacks_total",
    "kvengine:request_queue_time_seconds_bucket",
    "kvengine:request_prefill_time_seconds_bucket",
    "kvengine:request_decode_time_seconds_bucket",
    "kvengine:request_prompt_tokens_bucket",
    "kvengine:request_generation_tokens_bucket",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
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
    # vLLM's label sets: hits and queries carry the same labels, so hits / queries is a rate.
    assert delta("kvengine:prefix_cache_hits_total") >= 48
    assert 'kvengine:prefix_cache_hits_total{model_name=' in after and 'tier=' not in "".join(
        line for line in after.splitlines() if line.startswith("kvengine:prefix_cache_hits"))
    assert delta("kvengine:request_queue_time_seconds_count") == 2
    assert delta("kvengine:request_prefill_time_seconds_count") == 2
    assert delta("kvengine:request_decode_time_seconds_count") == 2
    assert delta("kvengine:request_prompt_tokens_sum") == 140
    assert delta("kvengine:request_generation_tokens_sum") == 10
    assert 'kvengine:attention_backend_info{decode="reference",prefill="reference"} 1.0' in after
    assert re.search(r"# TYPE kvengine:num_preemptions(_total)? counter", after)
    assert metric_value(after, "kvengine:kv_blocks_total") > 0
