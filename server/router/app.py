"""build_router_app: the OpenAI-compatible front of `kvengine router`, over several engines.

The engines' endpoints, passed through (``proxy.py``): /v1/completions and
/v1/chat/completions go where ``RequestRouter`` says (by KV, round-robin or load), /tokenize,
/detokenize, /version and /v1/models to the least loaded ready engine. The router's own:
/health (200 while it runs), /ready (200 while an engine is ready), /metrics (its counters;
behind the operator's metrics key as in `kvengine serve`). Request bodies are bounded as
`kvengine serve` bounds them, and API keys are checked as the engines check them (the same
middleware, so a refusal reads the same), then passed on with the request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvstore import StoreState
from kvstore.cli.args import package_version
from server.auth import KEY_SALT_SCOPE, APIKeyMiddleware
from server.body_limit import BodyLimitMiddleware
from server.errors import error_response, install_error_handlers
from server.router.engine_pool import EnginePool
from server.router.kv_locator import KVLocator
from server.router.metrics import CONTENT_TYPE
from server.router.proxy import RouterProxy
from server.router.request_router import CHAT, COMPLETION, RequestRouter
from server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES
from server.trailing_slash import TrailingSlash


@dataclass(frozen=True)
class RouterSettings:
    """The HTTP side of the router (the routing itself is in RequestRouter)."""

    api_keys: tuple[str, ...] = ()
    metrics_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES


def streams(body: bytes) -> bool:
    """Whether a generation request asks for a stream (``"stream": true``); the body is parsed
    only when it names ``stream`` at all."""
    if b'"stream"' not in body:
        return False
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


def build_router_app(router: RequestRouter, proxy: RouterProxy,
                     settings: RouterSettings = RouterSettings(),
                     on_shutdown: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The router's app; probing the engines starts and stops with its lifespan (the first
    round of probes before it serves), ``on_shutdown`` runs after."""
    pool: EnginePool = router.pool
    locator: KVLocator | None = router.locator

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.probe_all()
        pool.start()
        try:
            yield
        finally:
            await pool.stop()
            if on_shutdown is not None:
                await on_shutdown()

    app = FastAPI(title="kvengine router", version=package_version(), lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.router = router
    install_error_handlers(app)
    # Innermost: keys are checked on the path as sent, then /path/ is answered as /path.
    app.add_middleware(TrailingSlash)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_request_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_keys=settings.api_keys,
                       metrics_key=settings.metrics_key)

    def next_engine(tried: set[str]):
        return router.least_loaded(exclude=tried)

    async def generation(request: Request, kind: str) -> Response:
        body = await request.body()
        routed = await router.route(kind, body, request.scope.get(KEY_SALT_SCOPE, ""))
        if routed is None:
            return await proxy.forward(request, body, None, next_engine, streaming=streams(body))
        engine, route = routed
        return await proxy.forward(request, body, engine, next_engine, route.work_s,
                                   streaming=streams(body))

    async def passed(request: Request) -> Response:
        body = await request.body()
        return await proxy.forward(request, body, router.least_loaded(), next_engine)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, CHAT)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        # by load, not by where its prefix is: the router renders no Responses input
        body = await request.body()
        return await proxy.forward(request, body, router.least_loaded(), next_engine,
                                   streaming=streams(body))

    for path, method in (("/v1/models", "GET"), ("/version", "GET"), ("/tokenize", "POST"),
                         ("/detokenize", "POST")):
        app.add_api_route(path, passed, methods=[method], include_in_schema=False)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", **_state(pool, locator)})

    @app.get("/ready")
    async def ready() -> Response:
        state = _state(pool, locator)
        if not pool.ready():
            return error_response(503, "no engine is ready", code="no_engine_ready")
        return JSONResponse({"status": "ready", **state})

    @app.get("/metrics")
    async def metrics() -> Response:
        store = locator.state if locator is not None else StoreState.UNKNOWN
        return Response(router.metrics.render(store), media_type=CONTENT_TYPE)

    return app


def _state(pool: EnginePool, locator: KVLocator | None) -> dict:
    return {"engines": {url: e.state.value for url, e in pool.engines.items()},
            "kv_store": locator.state.value if locator is not None else None}
