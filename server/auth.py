"""API-key check (an ASGI middleware) and the tenant salt that keeps tenants' cached KV apart."""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from server.api_error import error_body

KEY_SALT_SCOPE = "kvengine.key_salt"  # scope entry the middleware sets for the route handlers
OPEN_PATHS = frozenset({"/health", "/ready", "/ping"})  # probes carry no key
METRICS_PATH = "/metrics"


def key_salt(api_key: str) -> str:
    """The tenant part of an API key: a digest, so the key itself never reaches a cache."""
    return hashlib.sha256(b"kvengine-api-key\x00" + api_key.encode()).hexdigest()[:32]


def tenant_salt(key_part: str, body_salt: str | None) -> str:
    """The engine's cache_salt for a request: key tenant and body `cache_salt`, unambiguously.

    Both empty gives "" (the shared default tenant). Fields are length-prefixed so that no
    (key, salt) pair can produce the same string as another pair.
    """
    body_salt = body_salt or ""
    if not key_part and not body_salt:
        return ""
    return f"k{len(key_part)}:{key_part}|s{len(body_salt)}:{body_salt}"


class APIKeyMiddleware:
    """Rejects requests without a valid `Authorization: Bearer KEY` (401) except on OPEN_PATHS.

    With no keys configured every request passes with an empty key salt. /metrics (every
    tenant's traffic) takes only the operator's `metrics_key`: while API keys are set a tenant's
    key gets 403 and no key or a wrong one 401 (so with no metrics key nobody reads it); without
    API keys it is open unless a metrics key is set.
    """

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...],
                 metrics_key: str | None = None) -> None:
        self._app = app
        self._salts = [(key.encode(), key_salt(key)) for key in api_keys]
        self._metrics_key = metrics_key.encode() if metrics_key is not None else None

    def _match(self, header: bytes | None) -> str | None:
        token = _bearer(header)
        if token is None:
            return None
        found = None
        for key, salt in self._salts:  # compare with every key: time does not reveal which one
            if hmac.compare_digest(token, key):
                found = salt
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        header = dict(scope.get("headers", ())).get(b"authorization")
        if scope["path"] == METRICS_PATH and (self._salts or self._metrics_key is not None):
            await self._metrics(scope, receive, send, header)
            return
        if not self._salts or scope["path"] in OPEN_PATHS:
            scope[KEY_SALT_SCOPE] = ""
            await self._app(scope, receive, send)
            return
        salt = self._match(header)
        if salt is None:
            message = "missing API key" if header is None else "invalid API key"
            await _reject(send, 401, message + " (send `Authorization: Bearer KEY`)",
                          "invalid_api_key")
            return
        scope[KEY_SALT_SCOPE] = salt
        await self._app(scope, receive, send)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send,
                       header: bytes | None) -> None:
        token = _bearer(header)
        if self._metrics_key is not None and token is not None and hmac.compare_digest(
                token, self._metrics_key):
            scope[KEY_SALT_SCOPE] = ""
            await self._app(scope, receive, send)
        elif token is not None and self._match(header) is not None:
            how = ("use the operator's metrics key" if self._metrics_key is not None else
                   "start the server with --metrics-key (or KVENGINE_METRICS_KEY) for the "
                   "operator")
            await _reject(send, 403, "a tenant's API key cannot read /metrics (it shows every "
                          f"tenant's traffic); {how}", "metrics_forbidden")
        else:
            message = "missing metrics key" if header is None else "invalid metrics key"
            await _reject(send, 401, message + " (/metrics needs `Authorization: Bearer "
                          "METRICS_KEY`, the operator's --metrics-key)", "invalid_api_key")


def _bearer(header: bytes | None) -> bytes | None:
    if header is None:
        return None
    scheme, _, token = header.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


async def _reject(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
