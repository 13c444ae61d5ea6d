"""build_app: the FastAPI app of the OpenAI-compatible engine API around one LLMEngine."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine.sampling_params import SamplingParams
from kvstore.cli.args import package_version
from server import openapi
from server.async_engine import AsyncEngine
from server.auth import APIKeyMiddleware
from server.body_limit import BodyLimitMiddleware
from server.engine_protocol import ServedEngine, kv_store_state
from server.errors import error_response, install_error_handlers
from server.http_metrics import HttpMetrics
from server.load_report import install_load_route
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.request_timing_log import NoTimingLog, RequestTimingLog
from server.responses_protocol import ResponsesRequest
from server.responses_serving import ResponsesServing
from server.serving import OpenAIServing
from server.settings import ServerSettings
from server.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizationServing,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from server.trailing_slash import TrailingSlash


def build_app(engine: ServedEngine, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving `engine` (an LLMEngine, or any ServedEngine). The step thread starts with
    the app's lifespan and stops with it; the caller still owns the engine and closes it after
    the server exits.

    `app.state.async_engine`, `.metrics` and `.model_name` are there for the CLI and tests.
    """
    settings = settings or ServerSettings()
    model_name = settings.served_model_name or str(engine.model_name)
    max_num_seqs = int(engine.config.max_num_seqs)
    metrics = ServerMetrics(model_name, engine)
    async_engine = AsyncEngine(engine, settings.max_in_flight(max_num_seqs),
                               on_finished=metrics.request_done, on_step=metrics.step_done)
    timing_log = (NoTimingLog() if settings.request_timing_log is None
                  else RequestTimingLog(settings.request_timing_log))
    serving = OpenAIServing(async_engine, metrics, model_name, SamplingParams,
                            settings.tools, settings.reasoning_parser, timing_log)
    model_names = (model_name, *settings.model_aliases)
    defaults = settings.sampling_defaults
    tokenization = TokenizationServing(engine.tokenizer, serving.prompts, frozenset(model_names),
                                       serving.max_model_len, int(engine.vocab_size))
    created = int(time.time())

    def prepared(body: Any) -> Any:
        """The body as the serving path takes it: an alias of the model named by its first name
        (responses carry the first, as vLLM's do), left-out fields from generation_config."""
        if body.model is not None and body.model in model_names[1:]:
            body = body.model_copy(update={"model": model_name})
        return body if defaults is None else defaults.apply(body)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            serving.prompts.close()
            timing_log.close()

    app = FastAPI(title="kvengine", version=package_version(), lifespan=lifespan,
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  redirect_slashes=False)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.model_name = model_name
    install_error_handlers(app)
    # Added last runs first: keys are checked (on the path as sent) before a body is read, then
    # the body is bounded, then /path/ is answered as /path.
    app.add_middleware(TrailingSlash)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_request_body_bytes,
                       on_refused=metrics.request_rejected)
    app.add_middleware(APIKeyMiddleware, api_keys=tuple(settings.api_keys),
                       metrics_key=settings.metrics_key)
    app.add_middleware(HttpMetrics, registry=metrics.registry)  # outermost: every request
    openapi.install(app, with_api_keys=bool(settings.api_keys))
    install_load_route(app, async_engine, engine, model_name)  # GET /load, for kvengine router

    @app.post("/v1/completions", response_model=None, responses={
        **openapi.GENERATION_RESPONSES,
        200: {**openapi.GENERATION_RESPONSES[200], "model": openapi.CompletionResponse}})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(prepared(body), request)

    @app.post("/v1/chat/completions", response_model=None, responses={
        **openapi.GENERATION_RESPONSES,
        200: {**openapi.GENERATION_RESPONSES[200], "model": openapi.ChatCompletionResponse}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(prepared(body), request)

    responses_api = ResponsesServing(serving, prepared)

    @app.post("/v1/responses", response_model=None, responses=openapi.GENERATION_RESPONSES)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await responses_api.create(body, request)

    @app.get("/v1/models", response_model=openapi.ModelList, responses=openapi.READ_RESPONSES)
    async def models() -> JSONResponse:
        cards = [{
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "kvengine",
            "root": str(engine.model_name),
            "max_model_len": serving.max_model_len,
        } for name in model_names]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/tokenize", response_model=TokenizeResponse,
              responses=openapi.TOKENIZE_RESPONSES)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest,
                       request: Request) -> JSONResponse:
        return JSONResponse(await tokenization.tokenize(body, request))

    # The body is read raw and bounded before it is parsed (TokenizationServing.detokenize);
    # its schema is still documented.
    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses=openapi.TOKENIZE_RESPONSES, openapi_extra={"requestBody": {
                  "required": True, "content": {"application/json": {
                      "schema": DetokenizeRequest.model_json_schema()}}}})
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await tokenization.detokenize(await request.body()))

    @app.get("/version", response_model=VersionResponse, responses=openapi.READ_RESPONSES)
    async def version() -> JSONResponse:
        return JSONResponse({"version": package_version()})

    @app.get("/ready", response_model=openapi.Ready, responses=openapi.READY_RESPONSES)
    async def ready() -> JSONResponse:
        if async_engine.alive:
            return JSONResponse({"ready": True, "reason": "serving"})
        why = "the step loop is not running" + (
            f" ({async_engine.error!r})" if async_engine.error is not None else "")
        return JSONResponse({"ready": False, "reason": why}, status_code=503)

    def health_response() -> Response:
        if not async_engine.alive:
            return error_response(503, f"engine is not running: {async_engine.error!r}",
                                  code="engine_dead")
        body = {"status": "ok"}
        state = kv_store_state(async_engine.stats())
        if state is not None:  # a hung or down store is served around by recomputing: still 200
            body["kv_store"] = state
        return JSONResponse(body)

    @app.get("/health", response_model=openapi.Health, responses=openapi.HEALTH_RESPONSES)
    async def health() -> Response:
        return health_response()

    # vLLM's /ping (SageMaker's probe, GET and POST as vLLM takes it): /health's answer.
    @app.api_route("/ping", methods=["GET", "POST"], response_model=openapi.Health,
                   responses=openapi.HEALTH_RESPONSES)
    async def ping() -> Response:
        return health_response()

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS_RESPONSES)
    async def prometheus() -> Response:
        metrics.update_engine(async_engine.stats(), async_engine.num_in_flight)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
