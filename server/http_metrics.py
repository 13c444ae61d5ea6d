"""HttpMetrics: vLLM's HTTP request series (from prometheus-fastapi-instrumentator), so a
dashboard built on vLLM's ``http_requests_total`` and ``http_request_duration_seconds`` reads
kvengine too.

``handler`` is the matched route's path template (``/v1/chat/completions``; for a request a
middleware answered before routing, such as a missing key, the route its path and method would
have matched), ``none`` when no route matches (so a scan of random paths adds no series);
``method`` one of the HTTP methods or ``other``; ``status`` grouped as ``2xx``, ``4xx``... as
the instrumentator groups it. The duration runs from the request's arrival to its last
response byte (a stream's whole length).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})
# the instrumentator's default buckets
_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0,
            60.0)


class HttpMetrics:
    """ASGI middleware counting every HTTP request into ``registry``."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self._requests = Counter("http_requests", "HTTP requests, by handler, method and "
                                 "status class.", ["handler", "method", "status"],
                                 registry=registry)
        self._duration = Histogram("http_request_duration_seconds", "HTTP request duration, "
                                   "arrival to the last response byte.", ["handler", "method"],
                                   buckets=_BUCKETS, registry=registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]  # what the client gets if the app raises before answering

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            handler = _handler(scope)
            method = scope.get("method", "")
            method = method if method in _METHODS else "other"
            self._requests.labels(handler, method, f"{status[0] // 100}xx").inc()
            self._duration.labels(handler, method).observe(time.perf_counter() - start)


def _handler(scope: Scope) -> str:
    route = scope.get("route")
    if route is None and "app" in scope:  # answered before routing: the route it was for
        routes = getattr(getattr(scope["app"], "router", None), "routes", ())
        route = next((r for r in routes if r.matches(scope)[0] == Match.FULL), None)
    return getattr(route, "path", None) or "none"
