"""/metrics: Prometheus text with request, token, latency, prefix-cache and KV-block metrics."""

from __future__ import annotations

import random
import re

import httpx
from server_helpers import METRICS_KEY, metric_value

OPERATOR = {"Authorization": f"Bearer {METRICS_KEY}"}

NAMES = [
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "kvengine:kv_blocks_in_use",
    "kvengine:kv_blocks_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:cache_config_info{",
    "kvengine:attention_backend_info{",
    "kvengine:attention_fallbacks_total",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:prompt_tokens_cached_total",
    "vllm:prompt_tokens_cached_by_source_total{",
    "vllm:num_requests_waiting_by_reason{",
    "vllm:request_prefill_kv_computed_tokens_bucket",
    "vllm:iteration_tokens_total_bucket",
    "vllm:admission_rejections_total{",
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

    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:prompt_tokens_total") == 140
    assert delta("vllm:generation_tokens_total") == 10
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    # the same first tokens by where the prefix came from: the first cold, the second an HBM hit
    assert delta("kvengine:time_to_first_token_by_source_seconds_count", source="cold") == 1
    assert delta("kvengine:time_to_first_token_by_source_seconds_count", source="hbm_hit") == 1
    assert delta("kvengine:time_to_first_token_by_source_seconds_count", source="restored") == 0
    assert delta("vllm:inter_token_latency_seconds_count") == 8
    assert delta("vllm:prefix_cache_queries_total") == 140
    # vLLM's label sets: hits and queries carry the same labels, so hits / queries is a rate.
    assert delta("vllm:prefix_cache_hits_total") >= 48
    # ... and vLLM's two labels on every series: the model and the engine's index.
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name=' in after
    assert 'tier=' not in "".join(
        line for line in after.splitlines() if line.startswith("vllm:prefix_cache_hits"))
    assert delta("vllm:request_queue_time_seconds_count") == 2
    assert delta("vllm:request_prefill_time_seconds_count") == 2
    assert delta("vllm:request_decode_time_seconds_count") == 2
    assert delta("vllm:request_prompt_tokens_sum") == 140
    assert delta("vllm:request_generation_tokens_sum") == 10
    assert 'kvengine:attention_backend_info{decode="reference",prefill="reference"} 1.0' in after
    assert re.search(r"# TYPE vllm:num_preemptions(_total)? counter", after)
    assert metric_value(after, "kvengine:kv_blocks_total") > 0
    # vLLM 0.32's newer series (issue 30 item 4): what the caches served and what was computed.
    hits = delta("vllm:prefix_cache_hits_total")
    assert delta("vllm:prompt_tokens_cached_total") == hits
    assert delta("vllm:prompt_tokens_cached_by_source_total", source="device") == hits
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == 140 - hits
    assert delta("vllm:request_prefill_kv_computed_tokens_count") == 2
    assert delta("vllm:iteration_tokens_total_sum") >= 140 - hits + 8
    assert metric_value(after, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
