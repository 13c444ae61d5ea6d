"""The FastAPI handlers that turn every failure (an APIError, a validation error, an HTTP
error, anything unexpected) into the OpenAI error shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api_error import APIError, error_body

logger = logging.getLogger("kvengine.server")


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSONResponse carrying the OpenAI error shape."""
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status,
                        headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    # loc starts with "body"; the rest names the field, e.g. ("body", "messages", 0, "role").
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return message, param


def is_json_type(content_type: str) -> bool:
    """``application/json`` or ``application/*+json`` (parameters such as charset aside), the
    types FastAPI reads a body of as JSON."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def install_error_handlers(app: FastAPI) -> None:
    """Map APIError, validation errors (422 in FastAPI) and HTTP errors to OpenAI errors."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type")
        if content_type is not None and not is_json_type(content_type):
            # FastAPI parses only JSON bodies; any other is a bytes value the schema refuses.
            return error_response(415, f"the request body must be JSON (Content-Type: "
                                  f"application/json), not {content_type!r}",
                                  code="unsupported_media_type")
        message, param = _describe_validation(exc)
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Keep the exception's headers: a 405 must list the allowed methods (`Allow`).
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
