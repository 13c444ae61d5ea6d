"""BodyLimitMiddleware: request bodies over a byte budget get a 413 before the app sees them, and
bodies of more JSON objects and arrays than ``MAX_JSON_CONTAINERS`` a 400.

Without it a 47 MiB prompt was buffered, parsed and tokenized whole (47 s on the event loop,
8 GB of RSS). The middleware reads the body itself, at most `max_body_bytes` of it, and hands the
app the bytes it read; a body that declares or turns out to be larger is refused. The rest of a
refused upload is read and dropped by the HTTP protocol (so the client gets to read its 413),
within the connection guard's request-read deadline.

The app parses and validates a body on the event loop, at a few microseconds per JSON object:
100,000 chat messages in 3.5 MB held every other request (``/health`` included) for 1.2 s. The
objects and arrays outside strings are counted first: ``bytes.count`` of the brackets bounds them
in a millisecond, and only a body whose brackets pass the budget has its strings stripped for the
exact count (tens of ms for 4 MB).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api_error import error_body

# JSON objects and arrays a body may hold: 20,000 chat messages, or hundreds of tools with their
# schemas, parse and validate in about 0.1 s.
MAX_JSON_CONTAINERS = 20_000
# A JSON string; one left open runs to the end of the body, so every match succeeds and the scan
# stays linear (a failed match restarting at each escaped quote made it quadratic).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)')


def json_containers_over(body: bytes, limit: int) -> int | None:
    """How many JSON objects and arrays ``body`` holds outside its strings, when more than
    ``limit``; else None (for malformed JSON a bound the parser then refuses anyway)."""
    if body.count(b"{") + body.count(b"[") <= limit:
        return None
    outside = _JSON_STRING.sub(b"", body)
    count = outside.count(b"{") + outside.count(b"[")
    return count if count > limit else None


class BodyLimitMiddleware:
    """ASGI middleware; `on_refused(code)` is called once per refused request (for metrics), with
    ``request_too_large`` or ``request_too_complex``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int,
                 on_refused: Callable[[str], None] | None = None,
                 max_json_containers: int = MAX_JSON_CONTAINERS) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self._app = app
        self.max_body_bytes = max_body_bytes
        self.max_json_containers = max_json_containers
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(send, int(declared))
            return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left mid-body: nobody to answer
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_body_bytes:
                await self._refuse(send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        containers = json_containers_over(body, self.max_json_containers)
        if containers is not None:
            await self._refuse_structure(send, containers)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # from here on only the disconnect

        await self._app(scope, replay, send)

    async def _refuse(self, send: Send, declared_bytes: int | None) -> None:
        size = f"{declared_bytes} bytes" if declared_bytes is not None else "more than that"
        await self._answer(send, 413, f"request body too large: the limit is "
                           f"{self.max_body_bytes} bytes, this one has {size} (kvengine serve "
                           "--max-request-body-bytes)", "request_too_large")

    async def _refuse_structure(self, send: Send, containers: int) -> None:
        await self._answer(send, 400, f"request body too complex: it holds {containers} JSON "
                           f"objects and arrays, at most {self.max_json_containers} are taken "
                           "(split the request)", "request_too_complex")

    async def _answer(self, send: Send, status: int, message: str, code: str) -> None:
        if self._on_refused is not None:
            self._on_refused(code)
        payload = json.dumps(error_body(status, message, code=code)).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]})
        await send({"type": "http.response.body", "body": payload})
