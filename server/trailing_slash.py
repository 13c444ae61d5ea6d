"""TrailingSlash: ``/v1/models/`` is answered as ``/v1/models``, never redirected.

Starlette redirects a path that matches only without its trailing slash (307) to an absolute URL
built from the request's ``Host`` header: a forged Host came back in ``Location`` (attacked from
outside, 2026-11-28, on the engine and on the router). Here the slash is dropped before routing,
so the route answers at once and nothing the client sent is reflected; the apps are built with
``redirect_slashes=False`` as well.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class TrailingSlash:
    """ASGI middleware: an HTTP path ending in ``/`` (other than ``/``) loses the slashes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
            raw = scope.get("raw_path")
            if isinstance(raw, bytes):
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)
