"""RouterMetrics: the router's Prometheus metrics, in a private registry.

Requests routed, by reason (``hbm_hit``, ``dram_hit``, ``miss``, ``fallback``, ...) and engine;
the hit length each routing decision expected; per-engine load and readiness as of the scrape;
what a decision cost (all of it, the prompt's tokens and chain, the daemon's ``locate`` round
trip); upstream failures and the retries they caused.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvstore import StoreState
from server.router.engine_pool import EnginePool, EngineState
from server.router.kv_event_feed import KVEventFeed
from server.router.policy import Route, RouteReason

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# Fine around a millisecond, where a routing decision's cost is (the budget is 2 ms).
_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
                    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    """What the router counts; ``render`` refreshes the per-engine gauges first."""

    def __init__(self, pool: EnginePool, feeds: Sequence[KVEventFeed] = ()) -> None:
        self._pool = pool
        self._feeds = tuple(feeds)  # vLLM engines' event feeds, whose counters render() reads
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self._routed = Counter(
            "kvengine:router_requests", "Requests routed, by reason and engine.",
            ["reason", "engine"], registry=reg)
        self._expected = Histogram(
            "kvengine:router_expected_hit_tokens", "Prompt tokens the routing decision "
            "expected to find cached on the node (the chosen engine's HBM, a peer's, DRAM, SSD).",
            ["reason"], buckets=_TOKEN_BUCKETS, registry=reg)
        self._route = Histogram(
            "kvengine:router_route_seconds", "Choosing the engine for a generation request, "
            "all of it: with kv routing the prompt's tokens and chain and the daemon's locate.",
            buckets=_SECONDS_BUCKETS, registry=reg)
        self._prompt = Histogram(
            "kvengine:router_prompt_seconds", "kv routing: a request's body parsed, its prompt "
            "rendered and tokenized as the engines do, its block chain hashed.",
            buckets=_SECONDS_BUCKETS, registry=reg)
        self._locate = Histogram(
            "kvengine:router_kv_locate_seconds", "Waits for the kvstore daemon's locate, "
            "answered or not (bounded by --kv-locate-timeout-ms).",
            buckets=_SECONDS_BUCKETS, registry=reg)
        self._upstream_errors = Counter(
            "kvengine:router_upstream_errors", "Requests an engine failed at the transport "
            "(unreachable, connection lost), by engine.", ["engine"], registry=reg)
        self._retries = Counter(
            "kvengine:router_retries", "Requests sent on to another engine after one could "
            "not take them.", registry=reg)
        self._unrouted = Counter(
            "kvengine:router_unrouted", "Requests answered 503: no engine was ready.",
            registry=reg)
        self._load = Gauge(
            "kvengine:router_engine_load", "Requests in flight at each engine, as the router "
            "estimates them (the engine's last report plus the router's own since).",
            ["engine"], registry=reg)
        self._prefill_rate = Gauge(
            "kvengine:router_engine_prefill_tokens_per_second", "Each engine's measured "
            "prefill rate as the cost model prices it (0 while it has measured none and the "
            "priors stand).", ["engine"], registry=reg)
        self._ready = Gauge(
            "kvengine:router_engine_ready", "1 while the engine answers its probes.",
            ["engine"], registry=reg)
        self._events = Gauge(
            "kvengine:router_kv_events", "vLLM engines' KV event feeds: batches, events, gaps, "
            "replayed batches, resyncs, restarts, unreadable batches, unkeyed and held blocks.",
            ["engine", "counter"], registry=reg)
        self._store = Gauge(
            "kvengine:router_kv_store_state", "1 for the kvstore daemon's state as the "
            "router last saw it.", ["state"], registry=reg)
        for reason in RouteReason:
            self._expected.labels(reason.value)
            for url in pool.engines:
                self._routed.labels(reason.value, url)
        for url in pool.engines:
            self._upstream_errors.labels(url)

    def routed(self, route: Route, block_size: int, seconds: float) -> None:
        self._routed.labels(route.reason.value, route.url).inc()
        self._expected.labels(route.reason.value).observe(route.expected_hit_blocks * block_size)
        self._route.observe(seconds)

    def prompted(self, seconds: float) -> None:
        self._prompt.observe(seconds)

    def located(self, seconds: float) -> None:
        self._locate.observe(seconds)

    def upstream_failed(self, url: str) -> None:
        self._upstream_errors.labels(url).inc()

    def retried(self) -> None:
        self._retries.inc()

    def unrouted(self) -> None:
        self._unrouted.inc()

    def render(self, store_state: StoreState) -> bytes:
        for url, engine in self._pool.engines.items():
            self._load.labels(url).set(engine.load)
            self._ready.labels(url).set(1 if engine.state is EngineState.READY else 0)
            costs = engine.costs
            self._prefill_rate.labels(url).set(1.0 / costs.prefill_s_per_token
                                               if costs.prefill_measured else 0.0)
        for state in StoreState:
            self._store.labels(state.value).set(1 if state is store_state else 0)
        for feed in self._feeds:
            for counter, value in feed.stats().items():
                self._events.labels(feed.name, counter).set(value)
        return generate_latest(self.registry)
