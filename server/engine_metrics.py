"""EngineCollector: the engine's own counters and levels as Prometheus families, at scrape time.

The engine owns its cumulative counts (prefix-cache tokens, preemptions, offload events), so they
are exported as counter families built from its latest stats snapshot, not as gauges set to a
running total. Names and label sets follow vLLM's where the meaning is the same:
`prefix_cache_{queries,hits}_total` for the engine's own HBM prefix cache (no tier label: vLLM's
hit-rate query divides one by the other), `external_prefix_cache_{queries,hits}_total` for what
the kvstore daemon supplied, and `external_prefix_cache_hits_by_tier_total{tier}` splitting that.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore import StoreState
from server.engine_protocol import ServedEngine, kv_store_state, offload_stats

P = "kvengine:"  # series vLLM has no name for
V = "vllm:"  # vLLM 0.32's names, where vLLM has one
# vLLM's labels on every series: the served model, and the engine's index (one engine a server).
LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"
# The store's tiers as vLLM's cache-hit sources (vllm:prompt_tokens_cached_by_source): another
# engine's HBM and another node are both another instance's cache (p2p).
HIT_SOURCES = {"dram": "host", "ssd": "disk", "hbm": "p2p", "hbm_peer": "p2p", "remote": "p2p"}
# Offload stats that are levels (how many now), not counts of events.
OFFLOAD_LEVELS = frozenset({"num_loading", "saves_in_flight", "blocks_quarantined_now"})
STORE_TIERS = ("hbm_peer", "dram", "ssd", "remote")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def attention_labels(backend: str) -> dict[str, str]:
    """``prefill=cudnn decode=ours`` -> {"prefill": "cudnn", "decode": "ours"}."""
    labels = dict(part.split("=", 1) for part in backend.split() if "=" in part)
    return {"prefill": labels.get("prefill", "unknown"), "decode": labels.get("decode", "unknown")}


class EngineCollector:
    """Families from `snapshot` (set by `update`) and the engine's fixed configuration."""

    def __init__(self, engine: ServedEngine, model_name: str) -> None:
        self._engine = engine
        self._ids = [model_name, ENGINE_INDEX]  # the values of LABELS
        self.snapshot: Mapping[str, Any] = {}
        self.num_in_flight = 0

    def update(self, snapshot: Mapping[str, Any], num_in_flight: int) -> None:
        self.snapshot = snapshot
        self.num_in_flight = num_in_flight

    def _gauge(self, name: str, doc: str, value: float | None) -> Iterator[Metric]:
        """``name`` carries its prefix (``V`` or ``P``)."""
        if value is not None:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._ids, value)
            yield family

    def _counter(self, name: str, doc: str, value: float | None) -> Iterator[Metric]:
        if value is not None:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._ids, value)
            yield family

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        yield from self._gauge(V + "num_requests_running", "Requests in the running batch.",
                               _number(s.get("num_running")))
        waiting, loading = _number(s.get("num_waiting")), _number(s.get("num_loading")) or 0.0
        yield from self._gauge(V + "num_requests_waiting", "Requests admitted but not running "
                               "yet (waiting for room, or for their KV from the store).",
                               None if waiting is None else waiting + loading)
        if waiting is not None:
            by_reason = GaugeMetricFamily(V + "num_requests_waiting_by_reason",
                                          "Waiting requests by reason: capacity (room in the "
                                          "batch or the KV pool), deferred (their KV is being "
                                          "loaded from the store).",
                                          labels=[*LABELS, "reason"])
            by_reason.add_metric([*self._ids, "capacity"], waiting)
            by_reason.add_metric([*self._ids, "deferred"], loading)
            yield by_reason
        yield from self._gauge(P + "num_requests_in_flight", "Engine requests admitted by the "
                               "server.", float(self.num_in_flight))
        total, used = _number(s.get("num_kv_blocks")), _number(s.get("num_blocks_in_use"))
        yield from self._gauge(P + "kv_blocks_in_use", "KV blocks held by requests.", used)
        yield from self._gauge(P + "kv_blocks_total", "KV blocks in the engine's pool.", total)
        if total and used is not None:
            yield from self._gauge(V + "kv_cache_usage_perc", "Fraction of KV blocks in use "
                                   "(0..1).", used / total)
        yield from self._counter(V + "prefix_cache_queries",
                                 "Prompt tokens looked up in the prefix cache (once a request).",
                                 _number(s.get("prefix_cache_queries")))
        yield from self._counter(V + "prefix_cache_hits",
                                 "Prompt tokens served by this engine's own prefix cache.",
                                 _number(s.get("prefix_cache_hits")))
        yield from self._counter(V + "num_preemptions", "Requests preempted (to be recomputed).",
                                 _number(s.get("num_preemptions")))
        yield from self._cached(s)
        yield from self._external(s)
        yield from self._configuration()

    def _cached(self, s: Mapping[str, Any]) -> Iterator[Metric]:
        """vLLM's cached prompt tokens, all and by source: ``device`` (this engine's HBM),
        ``host`` (the store's DRAM), ``disk`` (its SSD), ``p2p`` (another engine's HBM,
        another node)."""
        own = _number(s.get("prefix_cache_hits"))
        if own is None:
            return
        offload = offload_stats(s) or {}
        restored = offload.get("restored_tokens_by_tier")
        restored = restored if isinstance(restored, Mapping) else {}
        by_source = dict.fromkeys(("device", "host", "disk", "p2p", "external_unspecified"), 0.0)
        by_source["device"] = own
        for tier, value in restored.items():
            source = HIT_SOURCES.get(str(tier), "external_unspecified")
            by_source[source] += _number(value) or 0.0
        yield from self._counter(V + "prompt_tokens_cached", "Prompt tokens served by a cache: "
                                 "this engine's prefix cache and the store.",
                                 sum(by_source.values()))
        family = CounterMetricFamily(V + "prompt_tokens_cached_by_source",
                                     "Cached prompt tokens by the cache that supplied them.",
                                     labels=[*LABELS, "source"])
        for source, value in by_source.items():
            family.add_metric([*self._ids, source], value)
        yield family

    def _external(self, s: Mapping[str, Any]) -> Iterator[Metric]:
        offload = offload_stats(s)
        if offload is None:
            return
        restored = offload.get("restored_tokens_by_tier")
        restored = restored if isinstance(restored, Mapping) else {}
        # As vLLM's connector stats: every prompt token is a query, hits are what it supplied.
        yield from self._counter(V + "external_prefix_cache_queries",
                                 "Prompt tokens the kvstore daemon was asked about.",
                                 _number(s.get("prefix_cache_queries")))
        yield from self._counter(V + "external_prefix_cache_hits",
                                 "Prompt tokens restored from the kvstore daemon (all tiers).",
                                 float(sum(_number(v) or 0.0 for v in restored.values())))
        by_tier = CounterMetricFamily(P + "external_prefix_cache_hits_by_tier",
                                      "Prompt tokens restored from the kvstore daemon, by tier.",
                                      labels=[*LABELS, "tier"])
        for tier in sorted(set(STORE_TIERS) | set(restored)):
            by_tier.add_metric([*self._ids, str(tier)], _number(restored.get(tier)) or 0.0)
        yield by_tier
        connector = offload.get("connector")
        events = dict(connector) if isinstance(connector, Mapping) else {}
        events.update(offload)  # the manager's names win where both count the same thing
        counts = CounterMetricFamily(P + "kv_offload_events",
                                     "The engine's --kv-offload event counts (lookups, loads, "
                                     "blocks_loaded, blocks_saved, errors_*...).",
                                     labels=[*LABELS, "event"])
        levels = GaugeMetricFamily(P + "kv_offload_in_flight",
                                   "The engine's --kv-offload work in progress now (num_loading, "
                                   "saves_in_flight, blocks_quarantined_now).",
                                   labels=[*LABELS, "what"])
        for key, value in sorted(events.items()):
            number = _number(value)
            if number is not None:
                (levels if key in OFFLOAD_LEVELS else counts).add_metric(
                    [*self._ids, key], number)
        yield counts
        yield levels
        yield from self._restore_estimates(offload.get("restore_policy"))
        state = kv_store_state(s)
        if state is not None:
            yield from self._gauge(P + "kv_store_up", "1 while the kvstore daemon answers, 0 while "
                                   "it is hung or down (the engine then recomputes).",
                                   1.0 if state is StoreState.OK else 0.0)

    def _restore_estimates(self, policy: Any) -> Iterator[Metric]:
        """The cost-aware restore policy's estimates now, and those of the last restore it
        declined (why a restore lost to recomputing)."""
        if not isinstance(policy, Mapping):
            return
        family = GaugeMetricFamily(P + "kv_offload_restore_estimate",
                                   "The restore policy's estimates: load bandwidth by tier "
                                   "(bytes/s), prefill tokens/s, step floor (s); last_declined_*: "
                                   "the last restore it declined (seconds, tokens).",
                                   labels=[*LABELS, "what"])
        values = {"prefill_tokens_per_s": policy.get("prefill_tokens_per_s"),
                  "step_floor_s": policy.get("step_floor_s")}
        bandwidth = policy.get("bandwidth_bytes_per_s")
        for tier, value in (bandwidth.items() if isinstance(bandwidth, Mapping) else ()):
            values[f"bandwidth_{tier}_bytes_per_s"] = value
        declined = policy.get("last_declined")
        for key, value in (declined.items() if isinstance(declined, Mapping) else ()):
            values[f"last_declined_{key}"] = value
        for what, value in sorted(values.items()):
            number = _number(value)
            if number is not None:
                family.add_metric([*self._ids, what], number)
        yield family

    def _configuration(self) -> Iterator[Metric]:
        config, runner = self._engine.config, self._engine.runner
        info = GaugeMetricFamily(V + "cache_config_info", "The KV cache's configuration (1).",
                                 labels=["block_size", "cache_dtype", "enable_prefix_caching",
                                         "gpu_memory_utilization", "num_gpu_blocks",
                                         "kv_offload", "kv_offload_policy"])
        info.add_metric([str(config.block_size), str(runner.ops.kv_dtype),
                         str(config.enable_prefix_caching), str(config.gpu_memory_utilization),
                         str(self.snapshot.get("num_kv_blocks", "")), str(config.kv_offload),
                         str(config.kv_offload_policy)], 1.0)
        yield info
        labels = attention_labels(runner.attention_backend)
        backend = GaugeMetricFamily(P + "attention_backend_info",
                                    "Which attention runs for prefill and decode (1).",
                                    labels=["prefill", "decode"])
        backend.add_metric([labels["prefill"], labels["decode"]], 1.0)
        yield backend
        yield from self._counter(P + "attention_fallbacks",
                                 "Attention calls the chosen backend refused (our kernel "
                                 "served them).", float(runner.ops.num_attention_fallbacks))
        yield self._by_label(
            CounterMetricFamily, P + "first_use_builds", "Graph captures, cuDNN builds or "
            "plan loads, and kernel modules compiled that a request waited for after the engine "
            "said ready (0 when the warm-up covered them).", "kind",
            runner.ops.builds.snapshot()["after"])
        yield self._by_label(
            CounterMetricFamily, P + "hidden_builds", "Builds or plan loads after ready that no "
            "request waited for (beside a device step, ending before it, or while idle).", "kind",
            runner.ops.builds.snapshot()["hidden"])
        yield self._by_label(
            CounterMetricFamily, P + "cudnn_background_builds", "What the cuDNN plan builder "
            "process did after ready, by outcome (our kernel serves a shape until its graph is "
            "back).", "outcome", runner.ops.background_builds)
        yield self._by_label(
            GaugeMetricFamily, P + "gpu_allocator_bytes", "Device memory the engine's allocator "
            "holds (held) and has handed out now (in_use); held minus in_use is its cache of "
            "freed blocks.", "state", runner.ops.allocator_bytes)

    def _by_label(self, family_type: type, name: str, doc: str, label: str,
                  values: Mapping[str, float]) -> Metric:
        """A family of one series per ``values`` key (its ``label``), sorted."""
        family = family_type(name, doc, labels=[*LABELS, label])
        for key, value in sorted(values.items()):
            family.add_metric([*self._ids, key], float(value))
        return family
