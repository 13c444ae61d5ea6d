"""The daemon's admin HTTP app: ``GET /health``, ``GET /ready``, ``GET /stats`` (JSON),
``GET /metrics``.

It only reads: every answer comes from ``DaemonHealth`` / ``Service.stats()`` at request time,
and the Prometheus registry is private to the app (no process-global collectors); the metrics'
names, types and help are declared in ``metrics.py``. It runs under
uvicorn on its own thread, so a slow scrape never delays the control socket.
"""

from __future__ import annotations

import logging
import resource
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from kvstore.daemon.health import DaemonHealth
from kvstore.daemon.metrics import DeclaredCollector
from kvstore.daemon.service import Service
from kvstore.http_guard.connection_guard import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedServer,
    fit_to_open_files,
)
from kvstore.rate_limited_log import RateLimitedLog

# The admin app answers health checks and metric scrapers: a few clients. Past this many open
# connections a new one gets a 503 at once; one that sends no request for 5 s, or not a whole
# one in 10 s, is closed. Without a bound, any local user (the port is TCP) could hold every
# descriptor of the daemon and lock its engines out.
DEFAULT_ADMIN_MAX_CONNECTIONS = 64
ADMIN_TIMEOUT_KEEP_ALIVE_S = 5.0
ADMIN_REQUEST_READ_TIMEOUT_S = 10.0
ADMIN_EVENTS = ("refused", "timed_out", "idle_closed")  # counted as admin_connections_<event>


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
    registry.register(DeclaredCollector(service.stats, health.report))  # kvstore/daemon/metrics
    registry.register(service.latency.histogram)
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
                 health: DaemonHealth | None = None,
                 max_connections: int = DEFAULT_ADMIN_MAX_CONNECTIONS) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only then (else ~40 ms Nagle stalls)
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from None
        limits = ConnectionLimits(max_connections=max_connections,
                                  timeout_keep_alive_s=ADMIN_TIMEOUT_KEEP_ALIVE_S,
                                  request_read_timeout_s=ADMIN_REQUEST_READ_TIMEOUT_S,
                                  accept_backlog=128)
        fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if fds != resource.RLIM_INFINITY:  # its connections and accept bursts: a quarter of
            limits = fit_to_open_files(limits, fds // 4)  # the descriptors, at most
        self._sock.listen(limits.accept_backlog)
        self.host, self.port = self._sock.getsockname()[:2]
        self.guard = ConnectionGuard(
            limits, RateLimitedLog(logging.getLogger("kvstore.admin")),
            cap_flag="--http-max-connections", timeout_flags="",
            on_event=lambda kind: service.counters.add(**{f"admin_connections_{kind}": 1}))
        service.counters.declare(f"admin_connections_{kind}" for kind in ADMIN_EVENTS)
        # asyncio's loop, also where uvloop is installed: under descriptor exhaustion uvloop's
        # server stopped answering /health for good (tests/reliability/test_daemon_fd_exhaustion).
        config = uvicorn.Config(create_app(service, health), log_level="warning",
                                access_log=False, lifespan="off", loop="asyncio",
                                http=self.guard.protocol_factory,
                                timeout_keep_alive=round(ADMIN_TIMEOUT_KEEP_ALIVE_S),
                                backlog=limits.accept_backlog)
        # Now, not lazily on the thread: its imports need file descriptors, and a daemon out of
        # them (clients holding every one) must not lose its admin app for good.
        config.load()
        self._server = GuardedServer(config, self.guard)
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
