"""ServerMetrics: Prometheus metrics of the engine API, in a private registry, named like vLLM's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from server.engine_protocol import kv_store_state, offload_stats
from server.responses import TIERS

FINISH_REASONS = ("stop", "length", "abort")
CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    """Counters the request path updates and gauges refreshed from the engine's stats snapshot.

    Token counters count tokens; prefix-cache queries are prompt tokens looked up and hits are
    the cached part of them by tier, so `sum(hits) <= queries` always holds.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry
        self._requests = Counter(
            "kvengine:request_success", "Engine requests finished, by finish reason.",
            labels + ["finished_reason"], registry=reg)
        self._rejected = Counter(
            "kvengine:request_rejected", "HTTP requests refused before reaching the engine.",
            labels + ["reason"], registry=reg)
        self._prompt_tokens = Counter(
            "kvengine:prompt_tokens", "Prompt tokens admitted.", labels, registry=reg)
        self._generation_tokens = Counter(
            "kvengine:generation_tokens", "Tokens generated.", labels, registry=reg)
        self._ttft = Histogram(
            "kvengine:time_to_first_token_seconds",
            "Arrival at the server (before tokenization) to the first generated token.",
            labels, buckets=_TTFT_BUCKETS, registry=reg)
        self._itl = Histogram(
            "kvengine:inter_token_latency_seconds", "Time between generated tokens.",
            labels, buckets=_ITL_BUCKETS, registry=reg)
        self._e2e = Histogram(
            "kvengine:e2e_request_latency_seconds", "Arrival to the last token of a request.",
            labels, buckets=_E2E_BUCKETS, registry=reg)
        self._cache_queries = Counter(
            "kvengine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            labels, registry=reg)
        self._cache_hits = Counter(
            "kvengine:prefix_cache_hits", "Prompt tokens served from cache, by tier.",
            labels + ["tier"], registry=reg)
        self._running = Gauge(
            "kvengine:num_requests_running", "Requests in the running batch.", labels,
            registry=reg)
        self._waiting = Gauge(
            "kvengine:num_requests_waiting", "Requests admitted but not running yet.", labels,
            registry=reg)
        self._blocks_in_use = Gauge(
            "kvengine:kv_blocks_in_use", "KV blocks held by requests.", labels, registry=reg)
        self._blocks_total = Gauge(
            "kvengine:kv_blocks_total", "KV blocks in the engine's pool.", labels, registry=reg)
        self._kv_usage = Gauge(
            "kvengine:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", labels,
            registry=reg)
        self._in_flight = Gauge(
            "kvengine:num_requests_in_flight", "Engine requests admitted by the server.",
            labels, registry=reg)
        self._offload_events = Gauge(
            "kvengine:kv_offload_events",
            "The engine's --kv-offload counters as of the last step (lookups, loads, "
            "blocks_loaded, blocks_saved, restores_declined, errors_*...): cumulative counts, "
            "exported as gauges because the engine owns them.",
            labels + ["event"], registry=reg)
        self._kv_store_up = Gauge(
            "kvengine:kv_store_up",
            "1 while the kvstore daemon answers, 0 while it is hung or down (the engine then "
            "recomputes); absent without --kv-offload.", labels, registry=reg)
        self._model = model_name
        # Touch every labelled child so a scrape lists zeros before the first request.
        for reason in FINISH_REASONS:
            self._requests.labels(model_name, reason)
        for tier in TIERS:
            self._cache_hits.labels(model_name, tier)
        self._rejected.labels(model_name, "overloaded")

    def request_admitted(self, num_prompt_tokens: int) -> None:
        """An engine request entered the engine with this many prompt tokens."""
        self._prompt_tokens.labels(self._model).inc(num_prompt_tokens)

    def request_rejected(self, reason: str) -> None:
        """An HTTP request was refused before the engine saw it (e.g. "overloaded")."""
        self._rejected.labels(self._model, reason).inc()

    def first_token(self, ttft_s: float, num_cached_tokens: int, num_prompt_tokens: int,
                    cached_tokens_by_tier: Mapping[str, int]) -> None:
        """The first output of an engine request: TTFT and its prefix-cache lookup."""
        self._ttft.labels(self._model).observe(ttft_s)
        self._cache_queries.labels(self._model).inc(num_prompt_tokens)
        for tier in TIERS:
            hits = int(cached_tokens_by_tier.get(tier, 0))
            if hits:
                self._cache_hits.labels(self._model, tier).inc(hits)

    def tokens_generated(self, num_tokens: int, since_last_s: float | None) -> None:
        """`num_tokens` new tokens arrived `since_last_s` after the previous ones (None: first)."""
        if num_tokens <= 0:
            return
        self._generation_tokens.labels(self._model).inc(num_tokens)
        if since_last_s is not None:
            per_token = since_last_s / num_tokens
            for _ in range(num_tokens):
                self._itl.labels(self._model).observe(per_token)

    def request_finished(self, finish_reason: str, e2e_s: float) -> None:
        """An engine request ended (including aborts by disconnect)."""
        self._requests.labels(self._model, finish_reason).inc()
        self._e2e.labels(self._model).observe(e2e_s)

    def update_engine(self, snapshot: Mapping[str, Any], num_in_flight: int) -> None:
        """Refresh the gauges from the latest engine stats snapshot (missing keys are skipped)."""
        self._in_flight.labels(self._model).set(num_in_flight)
        for gauge, key in (
            (self._running, "num_running"),
            (self._waiting, "num_waiting"),
            (self._blocks_in_use, "num_blocks_in_use"),
            (self._blocks_total, "num_kv_blocks"),
        ):
            value = snapshot.get(key)
            if isinstance(value, int | float):
                gauge.labels(self._model).set(value)
        offload = offload_stats(snapshot)
        if offload is not None:
            connector = offload.get("connector")
            events = dict(connector) if isinstance(connector, Mapping) else {}
            events.update(offload)  # the manager's names win where both count the same thing
            for event, value in events.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._offload_events.labels(self._model, event).set(value)
        state = kv_store_state(snapshot)
        if state is not None:
            self._kv_store_up.labels(self._model).set(1 if state == "ok" else 0)
        total = snapshot.get("num_kv_blocks")
        used = snapshot.get("num_blocks_in_use")
        if isinstance(total, int | float) and isinstance(used, int | float) and total > 0:
            self._kv_usage.labels(self._model).set(used / total)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
