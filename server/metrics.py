"""ServerMetrics: Prometheus metrics of the engine API, in a private registry, under vLLM 0.32's
names (``vllm:*``, so vLLM's dashboards and alerts read kvengine); ``kvengine:*`` only for series
vLLM has no name for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.outputs import FinishReason, prefix_source
from server.engine_metrics import ENGINE_INDEX, LABELS, EngineCollector
from server.engine_protocol import EngineOutput, ServedEngine

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                  40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000, 200000)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    """What the request path observes (latencies, token counts, finish reasons) plus, with an
    `engine`, the engine's own counters and levels (EngineCollector) and process metrics."""

    def __init__(self, model_name: str, engine: ServedEngine | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = list(LABELS)
        reg = self.registry
        self._requests = Counter(
            "vllm:request_success", "Engine requests finished, by finish reason.",
            labels + ["finished_reason"], registry=reg)
        self._rejected = Counter(
            "vllm:admission_rejections", "HTTP requests refused before reaching the engine "
            "(overloaded: the queue limit; request_too_large, request_too_complex), by reason.",
            labels + ["reason"], registry=reg)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens admitted.", labels, registry=reg)
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=reg)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival at the server (before tokenization) to the first generated token.",
            labels, buckets=_TTFT_BUCKETS, registry=reg)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between generated tokens.",
            labels, buckets=_ITL_BUCKETS, registry=reg)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to the last token of a request.",
            labels, buckets=_E2E_BUCKETS, registry=reg)
        self._request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of finished requests.",
            labels, buckets=_TOKEN_BUCKETS, registry=reg)
        self._request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens of finished requests.",
            labels, buckets=_TOKEN_BUCKETS, registry=reg)
        self._prefill_computed = Histogram(
            "vllm:request_prefill_kv_computed_tokens", "Prompt tokens a finished request "
            "computed (not served by a cache, this engine's or the store's).",
            labels, buckets=_TOKEN_BUCKETS, registry=reg)
        self._iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Tokens computed per engine step.",
            labels, buckets=_TOKEN_BUCKETS, registry=reg)
        self._phases = {phase: Histogram(
            f"vllm:request_{phase}_time_seconds", doc, labels, buckets=_PHASE_BUCKETS,
            registry=reg) for phase, doc in (
                ("queue", "Added to the engine to first scheduled."),
                ("prefill", "First scheduled to the first token."),
                ("decode", "First token to the last."),
                ("inference", "First scheduled to the last token."))}
        self._ttft_by_source = Histogram(
            "kvengine:time_to_first_token_by_source_seconds",
            "Arrival at the server to the first token, by where the prompt's cached prefix came "
            "from: restored (part of it from the kvstore daemon), hbm_hit (this engine's HBM "
            "only) or cold (nothing cached).",
            labels + ["source"], buckets=_TTFT_BUCKETS, registry=reg)
        self._ids = (model_name, ENGINE_INDEX)  # the values of LABELS
        ProcessCollector(registry=reg)  # process_cpu_seconds_total, resident memory, open fds
        self.engine = EngineCollector(engine, model_name) if engine is not None else None
        if self.engine is not None:
            reg.register(self.engine)
        # Touch every labelled child so a scrape lists zeros before the first request.
        for reason in FinishReason:
            self._requests.labels(*self._ids, reason.value)
        self._rejected.labels(*self._ids, "overloaded")
        for source in ("restored", "hbm_hit", "cold"):
            self._ttft_by_source.labels(*self._ids, source)
        for family in (self._prompt_tokens, self._generation_tokens, self._ttft, self._itl,
                       self._e2e, self._request_prompt_tokens, self._request_generation_tokens,
                       self._prefill_computed, self._iteration_tokens, *self._phases.values()):
            family.labels(*self._ids)

    def request_admitted(self, num_prompt_tokens: int) -> None:
        """An engine request entered the engine with this many prompt tokens."""
        self._prompt_tokens.labels(*self._ids).inc(num_prompt_tokens)

    def request_rejected(self, reason: str) -> None:
        """An HTTP request was refused before the engine saw it (e.g. "overloaded")."""
        self._rejected.labels(*self._ids, reason).inc()

    def first_token(self, ttft_s: float, num_cached_tokens: int, num_prompt_tokens: int,
                    cached_tokens_by_tier: Mapping[str, int]) -> None:
        """The first output of an engine request. The prefix-cache counters come from the
        engine's own stats (see EngineCollector); the cache arguments are kept for callers."""
        self._ttft.labels(*self._ids).observe(ttft_s)
        source = prefix_source(dict(cached_tokens_by_tier))
        self._ttft_by_source.labels(*self._ids, source).observe(ttft_s)

    def tokens_generated(self, num_tokens: int, since_last_s: float | None) -> None:
        """`num_tokens` new tokens arrived `since_last_s` after the previous ones (None: first)."""
        if num_tokens <= 0:
            return
        self._generation_tokens.labels(*self._ids).inc(num_tokens)
        if since_last_s is not None:
            per_token = since_last_s / num_tokens
            for _ in range(num_tokens):
                self._itl.labels(*self._ids).observe(per_token)

    def request_finished(self, finish_reason: str, e2e_s: float) -> None:
        """An engine request ended (including aborts by disconnect)."""
        self._requests.labels(*self._ids, finish_reason).inc()
        self._e2e.labels(*self._ids).observe(e2e_s)

    def request_done(self, out: EngineOutput) -> None:
        """An engine request's last output: its token counts and where its time went."""
        ids = self._ids
        self._request_prompt_tokens.labels(*ids).observe(len(out.prompt_token_ids))
        self._request_generation_tokens.labels(*ids).observe(len(out.token_ids))
        if out.first_token_time is not None:  # its prefill ran: what it computed of the prompt
            computed = len(out.prompt_token_ids) - int(out.num_cached_tokens or 0)
            self._prefill_computed.labels(*ids).observe(max(0, computed))
        scheduled, first, end = out.first_scheduled_time, out.first_token_time, out.output_time
        if scheduled is None:
            return  # aborted while queued: it has no phases
        self._phases["queue"].labels(*ids).observe(max(0.0, scheduled - out.arrival_time))
        self._phases["inference"].labels(*ids).observe(max(0.0, end - scheduled))
        if first is not None:
            self._phases["prefill"].labels(*ids).observe(max(0.0, first - scheduled))
            self._phases["decode"].labels(*ids).observe(max(0.0, end - first))

    def step_done(self, num_tokens: int) -> None:
        """One engine step computed ``num_tokens`` tokens (from the step thread)."""
        if num_tokens > 0:
            self._iteration_tokens.labels(*self._ids).observe(num_tokens)

    def update_engine(self, snapshot: Mapping[str, Any], num_in_flight: int) -> None:
        """Hand the latest engine stats snapshot to the engine collector (read at scrape)."""
        if self.engine is not None:
            self.engine.update(snapshot, num_in_flight)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
