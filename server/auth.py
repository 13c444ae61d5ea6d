"""API-key check (an ASGI middleware) and the tenant salt that keeps tenants' cached KV apart."""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_body

KEY_SALT_SCOPE = "kvengine.key_salt"  # scope entry the middleware sets for the route handlers
OPEN_PATHS = frozenset({"/health"})


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

    With no keys configured every request passes with an empty key salt.
    """

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self._app = app
        self._salts = [(key.encode(), key_salt(key)) for key in api_keys]

    def _match(self, header: bytes | None) -> str | None:
        if header is None:
            return None
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        found = None
        for key, salt in self._salts:  # compare with every key: time does not reveal which one
            if hmac.compare_digest(token, key):
                found = salt
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._salts:
            if scope["type"] == "http":
                scope[KEY_SALT_SCOPE] = ""
            await self._app(scope, receive, send)
            return
        if scope["path"] in OPEN_PATHS:
            scope[KEY_SALT_SCOPE] = ""
            await self._app(scope, receive, send)
            return
        header = dict(scope.get("headers", ())).get(b"authorization")
        salt = self._match(header)
        if salt is None:
            message = "missing API key" if header is None else "invalid API key"
            body = json.dumps(
                error_body(401, message + " (send `Authorization: Bearer KEY`)",
                           code="invalid_api_key")
            ).encode()
            await send({
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            })
            await send({"type": "http.response.body", "body": body})
            return
        scope[KEY_SALT_SCOPE] = salt
        await self._app(scope, receive, send)
