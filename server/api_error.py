"""APIError and the OpenAI error shape: what a request's failure carries to the client,
with no web framework in it (the tool parsers and request checks the CLI's argument modules
import need it before FastAPI loads)."""

from __future__ import annotations

from typing import Any

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    503: "server_error",
}


class APIError(Exception):
    """A failure the client should see as `{"error": {...}}` with `status`."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` as the OpenAI API sends it."""
    kind = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
