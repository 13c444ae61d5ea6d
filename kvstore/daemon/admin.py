"""The daemon's admin HTTP app: ``GET /health``, ``GET /ready``, ``GET /stats`` (JSON),
``GET /metrics``.

It only reads: every answer comes from ``DaemonHealth`` / ``Service.stats()`` at request time,
and the Prometheus registry is private to the app (no process-global collectors). It runs under
uvicorn on its own thread, so a slow scrape never delays the control socket.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from kvstore.daemon.health import DaemonHealth, LoopState, SsdState, Status
from kvstore.daemon.service import Service

_TIER_GAUGES = ("capacity_bytes", "used_bytes", "blocks")
# The cluster section's levels; every other number in it only ever grows (a counter).
_CLUSTER_GAUGES = frozenset({"suspect_peers", "live_nodes", "pending_events", "published_blocks",
                             "connections"})
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_name(*parts: str) -> str:
    return _NAME_UNSAFE.sub("_", "_".join(p for p in parts if p))


def _is_counter(name: str) -> bool:
    return name.endswith(("_total", "hits", "misses", "count")) or name in {
        "hits", "misses", "collisions", "evictions", "demotions", "promotions"}


class StatsCollector:
    """Turns one ``Service.stats()`` snapshot into metric families, at scrape time."""

    def __init__(self, service: Service, health: DaemonHealth) -> None:
        self.service = service
        self.health = health

    def collect(self) -> Iterator[Metric]:
        yield from self._health(self.health.report())  # first: it may mark Redis down
        stats = self.service.stats()
        yield from self._tiers(stats.get("tiers") or {})
        yield from self._daemon(stats.get("daemon") or {})
        counters = stats.get("counters") or {}
        for key, value in sorted(counters.items()):  # the store's counted outcomes
            if _is_number(value):
                yield CounterMetricFamily(_metric_name("kvstore_store", key),
                                          f"store counter {key}", value=float(value))
        yield from self._cluster(stats.get("cluster"))
        yield from self._latency()
        # Anything else the store reports that is a number (or a map of numbers) goes out too.
        for key, value in sorted(stats.items()):
            if key in ("tiers", "daemon", "counters", "cluster"):
                continue
            yield from self._flat(_metric_name("kvstore_store", key), value)

    def _tiers(self, tiers: dict) -> Iterator[Metric]:
        by_name: dict[str, tuple[str, list[tuple[str, float]]]] = {}
        for tier, fields in sorted(tiers.items()):
            if not isinstance(fields, dict):
                continue
            for field, value in sorted(fields.items()):
                if _is_number(value):
                    kind = "gauge" if field in _TIER_GAUGES or not _is_counter(field) else \
                        "counter"
                    by_name.setdefault(field, (kind, []))[1].append((tier, float(value)))
                elif field == "counters" and isinstance(value, dict):  # e.g. the SSD's corrupt
                    for name, count in value.items():
                        if _is_number(count):
                            by_name.setdefault(name, ("counter", []))[1].append(
                                (tier, float(count)))
        for field, (kind, samples) in sorted(by_name.items()):
            name = _metric_name("kvstore_tier", field.removesuffix("_total"))
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, f"per-tier {field}", labels=["tier"])
            for tier, value in samples:
                family.add_metric([tier], value)
            yield family

    def _health(self, report: dict) -> Iterator[Metric]:
        """What ``/health`` says, as gauges: one series per state, 1 for the current one."""
        status = GaugeMetricFamily("kvstore_health_status", "1 for the daemon's health status "
                                   "(ok, degraded: a tier or Redis out, failing: the control "
                                   "loop stalled)", labels=["status"])
        for value in Status:
            status.add_metric([value.value], float(report["status"] == value.value))
        yield status
        age = report["control_loop"]["last_tick_age_s"]
        yield GaugeMetricFamily("kvstore_control_loop_last_tick_age_seconds",
                                "seconds since the control loop last ticked (it ticks every "
                                "0.1 s; past 0.5 s it is stalled)",
                                value=float("nan") if age is None else float(age))
        yield GaugeMetricFamily("kvstore_control_loop_stalled", "1 while the control loop has "
                                "not ticked for 0.5 s",
                                value=float(report["control_loop"]["state"]
                                            == LoopState.STALLED.value))
        ssd = GaugeMetricFamily("kvstore_ssd_state", "1 for the SSD tier's state (off, ok, "
                                "read_only, failing: IO errors in the last minute)",
                                labels=["state"])
        for value in SsdState:
            ssd.add_metric([value.value], float(report["ssd"]["state"] == value.value))
        yield ssd
        if report["redis"]["state"] != "off":
            yield GaugeMetricFamily("kvstore_redis_up", "1 while Redis (--cluster) answers",
                                    value=float(report["redis"]["state"] == "up"))

    def _daemon(self, daemon: dict) -> Iterator[Metric]:
        for name, labelled, label in (("requests", "kvstore_requests", "verb"),
                                      ("errors", "kvstore_errors", "code"),
                                      ("events", "kvstore_events", "event"),
                                      ("copies", "kvstore_copy_batches", "way")):
            family = CounterMetricFamily(labelled, f"daemon {name} by {label}", labels=[label])
            for key, value in sorted((daemon.get(name) or {}).items()):
                family.add_metric([str(key)], float(value))
            yield family
        if _is_number(daemon.get("uptime_s")):  # Prometheus names a unit in full: _seconds
            yield GaugeMetricFamily("kvstore_uptime_seconds", "daemon uptime in seconds",
                                    value=float(daemon["uptime_s"]))
        for gauge in ("connections", "leases_active", "registrations"):
            if _is_number(daemon.get(gauge)):
                yield GaugeMetricFamily(_metric_name("kvstore", gauge), f"daemon {gauge}",
                                        value=float(daemon[gauge]))

    def _latency(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "kvstore_request_duration_seconds",
            "lookup, load and save: request received to reply sent", labels=["verb"])
        for verb, (buckets, total_s) in self.service.latency.snapshot().items():
            family.add_metric([verb], buckets, total_s)
        yield family

    def _cluster(self, cluster: Any) -> Iterator[Metric]:
        """``kvstore_cluster_*``: remote outcomes, then the index, peer server and client's."""
        if not isinstance(cluster, dict):
            return
        index = cluster.get("index") or {}
        yield GaugeMetricFamily("kvstore_cluster_index_up", "1 while Redis answers",
                                value=float(index.get("state") == "up"))
        for section, fields in [("", cluster), *((k, v) for k, v in sorted(cluster.items())
                                                 if isinstance(v, dict))]:
            for key, value in sorted(fields.items()):
                if not _is_number(value):
                    continue
                name = _metric_name("kvstore_cluster", section, key)
                family = GaugeMetricFamily if key in _CLUSTER_GAUGES else CounterMetricFamily
                yield family(name, " ".join(filter(None, ("cluster", section, key))),
                             value=float(value))

    def _flat(self, name: str, value: Any, depth: int = 0) -> Iterator[Metric]:
        if _is_number(value):
            family = CounterMetricFamily if _is_counter(name) else GaugeMetricFamily
            yield family(name.removesuffix("_total"), name, value=float(value))
        elif isinstance(value, dict) and depth < 3:
            for key, sub in sorted(value.items()):
                yield from self._flat(_metric_name(name, str(key)), sub, depth + 1)


class LoopReport(BaseModel):
    state: str  # starting, ok, stalled, stopping
    last_tick_age_s: float | None


class ComponentReport(BaseModel):
    state: str
    reason: str


class HealthReply(BaseModel):
    """``status``: ok, degraded (serving, with the SSD tier or Redis out: 200) or failing (the
    control loop stalled: 503); ``problems`` says what, one line each."""

    status: str
    uptime_s: float
    pid: int
    version: str
    control_loop: LoopReport
    ssd: ComponentReport  # off, ok, read_only, failing
    redis: ComponentReport  # off (no --cluster), up, down
    problems: list[str]


class ReadyReply(BaseModel):
    ready: bool
    reason: str


class TierStats(BaseModel):
    capacity_bytes: int
    used_bytes: int
    blocks: int


class Tiers(BaseModel):
    """DRAM and SSD are always there (SSD with zeros when off); other tiers may be added."""

    dram: TierStats
    ssd: TierStats


class DaemonStats(BaseModel):
    uptime_s: float
    connections: int
    leases_active: int
    registrations: int
    requests: dict[str, int]
    errors: dict[str, int]
    events: dict[str, int]


class StatsReply(BaseModel):
    """The fields `/stats` always has; the store adds more (counters, cluster...)."""

    tiers: Tiers
    counters: dict[str, int]
    daemon: DaemonStats


def create_app(service: Service, health: DaemonHealth | None = None) -> FastAPI:
    """The admin app over ``service``; each app has its own Prometheus registry. ``health``:
    the probes' view of the daemon (without one, of ``service`` alone: no loop, never ready)."""
    app = FastAPI(title="kvstore admin", docs_url=None, redoc_url=None, openapi_url=None)
    health = health if health is not None else DaemonHealth(service)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(service, health))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, resident memory, fds

    # The routes answer with ready JSON; the models only document it (the OpenAPI schema that
    # tests/reliability/test_http_schema.py fuzzes the daemon against).
    @app.get("/health", response_model=HealthReply,
             responses={503: {"model": HealthReply, "description": "the control loop stalled"}})
    def health_route() -> JSONResponse:
        report = health.report()
        return JSONResponse(report, status_code=503 if report["status"] == "failing" else 200)

    @app.get("/ready", response_model=ReadyReply,
             responses={503: {"model": ReadyReply, "description": "not serving (yet)"}})
    def ready_route() -> JSONResponse:
        ready, reason = health.ready()
        return JSONResponse({"ready": ready, "reason": reason},
                            status_code=200 if ready else 503)

    @app.get("/stats", response_model=StatsReply)
    def stats() -> JSONResponse:
        return JSONResponse(service.stats())

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus text
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class AdminServer:
    """uvicorn serving ``create_app(service)`` on a thread; binds in the constructor."""

    def __init__(self, service: Service, host: str, port: int,
                 health: DaemonHealth | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only then (else ~40 ms Nagle stalls)
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from None
        self._sock.listen(128)
        self.host, self.port = self._sock.getsockname()[:2]
        # asyncio's loop, also where uvloop is installed: under descriptor exhaustion uvloop's
        # server stopped answering /health for good (tests/reliability/test_daemon_fd_exhaustion).
        config = uvicorn.Config(create_app(service, health), log_level="warning",
                                access_log=False,
                                lifespan="off", loop="asyncio")
        # Now, not lazily on the thread: its imports need file descriptors, and a daemon out of
        # them (clients holding every one) must not lose its admin app for good.
        config.load()
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]},
                                        name="kvstore-admin", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start serving on the thread; returns once its event loop serves (bounded), so the
        daemon says ready only after that: a client flood right after cannot leave the admin
        app without the descriptors its loop needs."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and \
                time.monotonic() < deadline:
            time.sleep(0.005)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._sock.close()
