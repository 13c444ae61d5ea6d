"""The engine API's OpenAPI description: response models, the error shape, the bearer scheme.

The routes answer with hand-built JSON (``server/responses.py``), so FastAPI cannot infer what they
send; the models here state it, and ``install`` fixes the rest of FastAPI's guesses: it drops the
422 FastAPI documents for every body (validation errors go out as 400 in the OpenAI error shape)
and declares the bearer scheme on every route but the open ones when keys are configured. The
schema is what ``tests/reliability/test_http_schema.py`` fuzzes the live server against.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.auth import OPEN_PATHS


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """With `logprobs: N`: per generated token its text, logprob, the N most likely
    alternatives (plus the token itself) and its offset in the text. With `echo` the prompt's
    tokens come first, the very first with null logprob and alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """One token of vLLM's `prompt_logprobs` (keyed by its id as a string)."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, null for the first, then its own entry followed by
# the N most likely ones
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    prompt_logprobs: PromptLogprobs | None = None  # with `prompt_logprobs`, or echo + logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """With `logprobs: true` (and `top_logprobs: N`)."""

    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with `prompt_logprobs`


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    """`kv_store` only with --kv-offload, where the offload layer reports the store's state;
    the engine serves (recomputing) whatever it is, so /health stays 200."""

    status: Literal["ok"]
    kv_store: Literal["ok", "hung", "down"] | None = None


class Ready(BaseModel):
    """Serving: the model is loaded and warmed (the server listens only after both) and the
    step loop runs."""

    ready: bool
    reason: str


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# With `stream: true`: server-sent events, each `data: {chunk JSON}`, the last `data: [DONE]`;
# the schema describes one event.
_EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}

GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the completion (JSON), or server-sent events with `stream: true`",
          "content": _EVENT_STREAM},
    400: _error("bad parameters, a malformed body, or a prompt over the context length"),
    401: _error("missing or wrong API key (when the server has keys)"),
    404: _error("`model` names a model this server does not serve"),
    413: _error("the request body is over --max-request-body-bytes"),
    415: _error("the request body is not JSON (its Content-Type is another)"),
    503: _error("overloaded (retry later) or the engine is not running"),
}
READ_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _error("missing or wrong API key (when the server has keys)"),
}
# /metrics answers text/plain, so FastAPI would file a `model` under text/plain: name the JSON.
_JSON_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "missing or wrong metrics key (when the server has API or metrics "
          "keys)", "content": _JSON_ERROR},
    403: {"description": "a tenant's API key, or API keys without a metrics key: /metrics "
          "shows every tenant's traffic and is for the operator", "content": _JSON_ERROR},
}
TOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("a malformed body, a token id outside the vocabulary, or a chat the template "
                "refuses"),
    401: _error("missing or wrong API key (when the server has keys)"),
    404: _error("`model` names a model this server does not serve"),
    413: _error("the request body is over --max-request-body-bytes"),
    415: _error("the request body is not JSON (its Content-Type is another)"),
    503: _error("overloaded (retry later)"),
}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: _error("the engine's step loop is not running"),
}
READY_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": Ready, "description": "not serving: the step loop has not started, has "
          "stopped or failed"},
}


def install(app: FastAPI, with_api_keys: bool) -> None:
    """Replace ``app.openapi`` with the honest schema (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
                if with_api_keys and path not in OPEN_PATHS:
                    operation["security"] = [{"bearer": []}]
        components = schema.setdefault("components", {})
        schemas = components.get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        if with_api_keys:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
