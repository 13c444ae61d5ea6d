"""The daemon's Prometheus metrics, declared: every family's name, type, help and labels is in
``FAMILIES`` (nothing is named or typed by guessing from the stats at scrape time). A scrape
reads one ``/health`` report and one ``Service.stats()`` snapshot and fills the families from
them; a family whose source is missing (no ``--cluster``) has no samples. The request
latency histogram is prometheus_client's (``latency.RequestLatency``), observed as requests end.

Events whose names are open-ended (a tier's IO outcomes, the cluster's counters, the daemon's
connection events) are one declared family each with the event as a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore.daemon.health import LoopState, SsdState, Status

Samples = Iterable[tuple[tuple[str, ...], float]]
TIER_LEVELS = ("capacity_bytes", "used_bytes", "blocks", "pinned_blocks", "in_flight_blocks",
               "demoting_blocks", "promoting_blocks", "files")
CLUSTER_LEVELS = frozenset({"suspect_peers", "live_nodes", "pending_events", "published_blocks",
                            "connections"})


@dataclass(frozen=True)
class Family:
    """One declared family: ``samples(stats, health)`` yields (label values, value)."""

    name: str  # counters without their _total: prometheus_client adds it
    kind: str  # "counter" or "gauge"
    help: str
    labels: tuple[str, ...]
    samples: Callable[[Mapping[str, Any], Mapping[str, Any]], Samples]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _at(tree: Mapping[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(tree, Mapping):
            return None
        tree = tree.get(key)
    return tree


def _one(*path: str) -> Callable[[Mapping, Mapping], Samples]:
    def samples(stats: Mapping, _: Mapping) -> Samples:
        value = _number(_at(stats, *path))
        return [((), value)] if value is not None else []
    return samples


def _by_key(*path: str) -> Callable[[Mapping, Mapping], Samples]:
    def samples(stats: Mapping, _: Mapping) -> Samples:
        values = _at(stats, *path)
        if not isinstance(values, Mapping):
            return []
        return [((str(k),), v) for k, n in sorted(values.items()) if (v := _number(n)) is not None]
    return samples


def _per_tier(field: str) -> Callable[[Mapping, Mapping], Samples]:
    def samples(stats: Mapping, _: Mapping) -> Samples:
        tiers = _at(stats, "tiers") or {}
        return [((tier,), v) for tier, fields in sorted(tiers.items())
                if isinstance(fields, Mapping) and (v := _number(fields.get(field))) is not None]
    return samples


def _tier_events(stats: Mapping, _: Mapping) -> Samples:
    tiers = _at(stats, "tiers") or {}
    return [((tier, str(event)), v) for tier, fields in sorted(tiers.items())
            if isinstance(fields, Mapping)
            for event, n in sorted((fields.get("counters") or {}).items())
            if (v := _number(n)) is not None]


def _cluster(levels: bool) -> Callable[[Mapping, Mapping], Samples]:
    """The cluster section's numbers (and its index, server and client sections'), split into
    levels and counts."""
    def samples(stats: Mapping, _: Mapping) -> Samples:
        cluster = _at(stats, "cluster")
        if not isinstance(cluster, Mapping):
            return []
        sections = [("node", cluster), *((k, v) for k, v in sorted(cluster.items())
                                         if isinstance(v, Mapping))]
        return [((section, str(key)), v) for section, fields in sections
                for key, n in sorted(fields.items())
                if (key in CLUSTER_LEVELS) == levels and (v := _number(n)) is not None]
    return samples


def _cluster_index_up(stats: Mapping, _: Mapping) -> Samples:
    cluster = _at(stats, "cluster")
    if not isinstance(cluster, Mapping):
        return []
    return [((), float(_at(cluster, "index", "state") == "up"))]


def _state_set(key: str, values: Iterable[str]) -> Callable[[Mapping, Mapping], Samples]:
    def samples(_: Mapping, health: Mapping) -> Samples:
        now = _at(health, key, "state") if key != "status" else health.get("status")
        return [((value,), float(now == value)) for value in values]
    return samples


def _loop_age(_: Mapping, health: Mapping) -> Samples:
    age = _number(_at(health, "control_loop", "last_tick_age_s"))
    return [((), float("nan") if age is None else age)]


def _loop_stalled(_: Mapping, health: Mapping) -> Samples:
    return [((), float(_at(health, "control_loop", "state") == LoopState.STALLED.value))]


def _redis_up(_: Mapping, health: Mapping) -> Samples:
    state = _at(health, "redis", "state")
    return [] if state in (None, "off") else [((), float(state == "up"))]


STORE_COUNTERS = {
    "lookups": "lookups the store answered", "lookup_blocks": "blocks looked up",
    "hit_blocks_dram": "blocks found in DRAM", "hit_blocks_ssd": "blocks found on SSD",
    "miss_blocks": "blocks looked up and not found", "collisions": "hash collisions refused",
    "leases_granted": "leases granted", "leases_expired": "leases that ran out",
    "puts": "puts stored", "put_bytes": "bytes put", "duplicate_puts": "puts already held",
    "put_collisions_dropped": "puts dropped on a collision",
    "collisions_replaced": "collided entries replaced", "put_too_large": "puts too large",
    "aborts": "writes aborted", "evictions": "blocks evicted from DRAM",
    "dram_releases": "DRAM slots released", "demotions": "blocks written DRAM to SSD",
    "demotion_failures": "demotions that failed", "promotions": "blocks read SSD to DRAM",
    "promotion_failures": "promotions that failed", "removes": "blocks removed",
    "puts_replaced": "puts that replaced a value", "put_busy": "puts refused while busy",
}

FAMILIES: tuple[Family, ...] = (
    Family("kvstore_health_status", "gauge", "1 for the daemon's health status (ok, degraded: "
           "a tier or Redis out, failing: the control loop stalled)", ("status",),
           _state_set("status", [s.value for s in Status])),
    Family("kvstore_control_loop_last_tick_age_seconds", "gauge", "seconds since the control "
           "loop last ticked (it ticks every 0.1 s; past 0.5 s it is stalled)", (), _loop_age),
    Family("kvstore_control_loop_stalled", "gauge", "1 while the control loop has not ticked "
           "for 0.5 s", (), _loop_stalled),
    Family("kvstore_ssd_state", "gauge", "1 for the SSD tier's state (off, ok, read_only, "
           "failing: IO errors in the last minute)", ("state",),
           _state_set("ssd", [s.value for s in SsdState])),
    Family("kvstore_redis_up", "gauge", "1 while Redis (--cluster) answers", (), _redis_up),
    *(Family(f"kvstore_tier_{field}", "gauge", f"per-tier {field.replace('_', ' ')} now",
             ("tier",), _per_tier(field)) for field in TIER_LEVELS),
    Family("kvstore_tier_hits", "counter", "blocks found in each tier", ("tier",),
           _per_tier("hits")),
    Family("kvstore_tier_misses", "counter", "blocks a tier was asked for and did not hold",
           ("tier",), _per_tier("misses")),
    Family("kvstore_tier_events", "counter", "each tier's own outcomes (SSD: writes, "
           "read_errors, corrupt...; HBM: copies, generation_failures...)", ("tier", "event"),
           _tier_events),
    *(Family(f"kvstore_store_{name}", "counter", f"store: {doc}", (), _one("counters", name))
      for name, doc in STORE_COUNTERS.items()),
    Family("kvstore_store_leases", "gauge", "leases the store holds now", (), _one("leases")),
    Family("kvstore_requests", "counter", "requests by verb", ("verb",),
           _by_key("daemon", "requests")),
    Family("kvstore_errors", "counter", "failed requests by error code", ("code",),
           _by_key("daemon", "errors")),
    Family("kvstore_events", "counter", "daemon events: connections closed and refused, "
           "leases dropped, frames refused...", ("event",), _by_key("daemon", "events")),
    Family("kvstore_copy_batches", "counter", "copy batches between engine memory and the "
           "store, by way", ("way",), _by_key("daemon", "copies")),
    Family("kvstore_uptime_seconds", "gauge", "daemon uptime in seconds", (),
           _one("daemon", "uptime_s")),
    Family("kvstore_connections", "gauge", "client connections open", (),
           _one("daemon", "connections")),
    Family("kvstore_leases_active", "gauge", "leases held by clients", (),
           _one("daemon", "leases_active")),
    Family("kvstore_registrations", "gauge", "engines registered", (),
           _one("daemon", "registrations")),
    Family("kvstore_key_filter_added", "counter", "block hashes the key filter took (saves "
           "and HBM publications, repeats counted)", (), _one("daemon", "key_filter", "added")),
    Family("kvstore_key_filter_rebuilds", "counter", "the key filter's rebuilds from the blocks "
           "held", (), _one("daemon", "key_filter", "rebuilds")),
    Family("kvstore_key_filter_false_positive_estimate", "gauge", "the chance that a hash no "
           "tier holds reads as held in the key filter (estimated from its adds)", (),
           _one("daemon", "key_filter", "false_positive_estimate")),
    Family("kvstore_cluster_index_up", "gauge", "1 while Redis answers the cluster index", (),
           _cluster_index_up),
    Family("kvstore_cluster_remote_hit_blocks", "counter", "blocks fetched from peers", (),
           _one("cluster", "remote_hit_blocks")),
    Family("kvstore_cluster_events", "counter", "the cluster node's counts: remote outcomes "
           "(node), its index, peer server and client", ("section", "event"), _cluster(False)),
    Family("kvstore_cluster_level", "gauge", "the cluster node's levels now (suspect peers, "
           "live nodes, pending index events...)", ("section", "what"), _cluster(True)),
)


class DeclaredCollector:
    """Fills ``FAMILIES`` from one health report and one stats snapshot per scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]],
                 health: Callable[[], Mapping[str, Any]]) -> None:
        self._stats, self._health = stats, health

    def collect(self) -> Iterator[Metric]:
        health = self._health()  # first: a Redis probe may mark the index down
        stats = self._stats()
        for family in FAMILIES:  # every one, with no samples where its source is absent
            samples = list(family.samples(stats, health))
            kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            metric = kind(family.name, family.help, labels=list(family.labels))
            for labels, value in samples:
                metric.add_metric(list(labels), value)
            yield metric
