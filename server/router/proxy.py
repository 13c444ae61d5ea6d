"""RouterProxy: a request passed to an engine, and the engine's response passed back unchanged.

The request goes out with the client's headers (Authorization included) and body as they came;
the response comes back with the engine's status, headers and bytes as they arrive (streams
are not re-framed, errors not rewritten), less the hop-by-hop headers. An engine that cannot be
reached before it answered (refused, reset, gone) is marked down and the request goes to the
next least loaded engine; once an engine has answered, its answer is the answer. A client that
disconnects, while waiting or while reading, cancels the upstream request (the engine aborts it).
Every answer an engine gave carries ``x-kvengine-engine``, naming the engine that served it:
by its name (``--engine NAME=URL``, else its position), or by its base URL where asked
(``--engine-header url``: internal addresses, for benchmarks), or not at all (``off``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

import httpx
from starlette.requests import Request
from starlette.responses import Response

from server.errors import error_response
from server.router.engine_pool import EnginePool, UpstreamEngine
from server.router.metrics import RouterMetrics
from server.streaming import ClientGone, EventStreamResponse, until_disconnect

logger = logging.getLogger("kvengine.router")

ENGINE_HEADER = "x-kvengine-engine"
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                         b"proxy-authorization", b"te", b"trailer", b"trailers",
                         b"transfer-encoding", b"upgrade"})
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length", b"expect"}
# uvicorn writes its own date and server headers; the engine header is the router's own.
_NOT_RETURNED = _HOP_BY_HOP | {b"date", b"server", ENGINE_HEADER.encode()}
# Nothing of the request reached the engine's application, or it died before answering: the
# request is sent to another engine. A timeout is not one of them (the engine may be working).
_UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                httpx.ReadError, httpx.WriteError)


def connection_named(raw: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names a message's ``Connection`` header lists: hop-by-hop for this message
    only, never forwarded (RFC 9110 7.6.1)."""
    return frozenset(token.strip().lower() for name, value in raw
                     if name.lower() == b"connection" for token in value.split(b",")
                     if token.strip())


class PassThroughResponse(EventStreamResponse):
    """The engine's response, bytes as they arrive; the client's disconnect cancels it."""

    def __init__(self, upstream: httpx.Response, engine: str | None, on_close: Callable[[], None],
                 on_broken: Callable[[BaseException], None],
                 on_first_chunk: Callable[[], None]) -> None:
        super().__init__(_raw_body(upstream, on_broken, on_first_chunk), on_close,
                         upstream.status_code)
        dropped = _NOT_RETURNED | connection_named(upstream.headers.raw)
        self.raw_headers = [(name, value) for name, value in upstream.headers.raw
                            if name.lower() not in dropped]
        if engine is not None:
            self.raw_headers.append((ENGINE_HEADER.encode(),
                                     engine.encode("ascii", "backslashreplace")))


async def _raw_body(upstream: httpx.Response, on_broken: Callable[[BaseException], None],
                    on_first_chunk: Callable[[], None]) -> AsyncGenerator[bytes, None]:
    try:
        async for chunk in upstream.aiter_raw():
            if chunk:
                on_first_chunk()
                yield chunk
    except httpx.TransportError as exc:  # the engine died mid-answer: the client's is cut off
        on_broken(exc)
        raise


class RouterProxy:
    """Sends requests to the pool's engines over one pooled HTTP transport.

    The transport itself, not an AsyncClient over it: a client keeps a cookie jar (an engine's
    cookie would go out with every later client's requests) and adds its own headers, redirect
    and auth handling (about 0.1 ms a request); a proxy wants none of them.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout,
                 pool: EnginePool, metrics: RouterMetrics,
                 first_byte_timeout_s: float | None = None,
                 engine_header: Callable[[str], str | None] = str) -> None:
        self._transport = transport
        self._timeout = timeout.as_dict()
        # A stream's response head leaves the engine when it admits the request, so an engine
        # silent longer than this is hung, not busy; a whole answer (no stream) has no such bound
        # beyond ``timeout`` (its head comes with its last token).
        self._first_byte_timeout_s = first_byte_timeout_s
        self._engine_header = engine_header  # an engine's URL to what x-kvengine-engine says
        self._pool = pool
        self._metrics = metrics

    async def forward(self, request: Request, body: bytes, engine: UpstreamEngine | None,
                      next_engine: Callable[[set[str]], UpstreamEngine | None],
                      queued_s: float = 0.0, streaming: bool = False) -> Response:
        """Send the request to ``engine``, or on to ``next_engine(tried)`` while engines turn
        out unreachable; the engine's response, or a 503 when none could take it.
        ``queued_s`` (the seconds of work the route expects of the first engine) count in
        its queue until its answer's first bytes arrive, or it fails. A ``streaming`` request
        whose engine sends no response head within the first-byte bound gets a 504."""
        tried: set[str] = set()
        while engine is not None:
            tried.add(engine.url)
            engine.in_flight += 1
            dequeue = _Queued(engine, queued_s)
            queued_s = 0.0  # an engine tried next takes it unannounced
            try:
                send = self._send(engine, request, body)
                if streaming and self._first_byte_timeout_s is not None:
                    send = asyncio.wait_for(send, self._first_byte_timeout_s)
                upstream = await until_disconnect(send, request.receive)
            except ClientGone:
                engine.in_flight -= 1
                dequeue()
                return Response(status_code=499)  # nobody reads it: the client is gone
            except _UNREACHABLE as exc:
                engine.in_flight -= 1
                dequeue()
                self._pool.mark_down(engine, f"{type(exc).__name__}: {exc}")
                self._metrics.upstream_failed(engine.url)
                engine = next_engine(tried)
                if engine is not None:
                    self._metrics.retried()
                continue
            except httpx.TimeoutException as exc:
                engine.in_flight -= 1
                dequeue()
                self._metrics.upstream_failed(engine.url)
                return error_response(504, f"engine {engine.url} did not answer in time "
                                      f"({type(exc).__name__})", code="upstream_timeout")
            except TimeoutError:  # the first-byte bound (asyncio.wait_for)
                engine.in_flight -= 1
                dequeue()
                self._metrics.upstream_failed(engine.url)
                return error_response(504, f"engine {engine.url} did not start its answer "
                                      f"within {self._first_byte_timeout_s:g} s",
                                      code="upstream_first_byte_timeout")
            except BaseException:
                engine.in_flight -= 1
                dequeue()
                raise
            return PassThroughResponse(upstream, self._engine_header(engine.url),
                                       _closer(engine, upstream.aclose, dequeue),
                                       lambda exc, e=engine: self._broken(e, exc), dequeue)
        self._metrics.unrouted()
        return error_response(503, "no engine is ready to take the request; retry later",
                              code="no_engine_ready")

    def _broken(self, engine: UpstreamEngine, exc: BaseException) -> None:
        self._metrics.upstream_failed(engine.url)
        if not isinstance(exc, httpx.TimeoutException):
            self._pool.mark_down(engine, f"answer cut off: {type(exc).__name__}: {exc}")

    async def _send(self, engine: UpstreamEngine, request: Request,
                    body: bytes) -> httpx.Response:
        dropped = _NOT_FORWARDED | connection_named(request.headers.raw)
        headers = [(name, value) for name, value in request.headers.raw
                   if name.lower() not in dropped]
        url = engine.url + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        upstream = httpx.Request(request.method, url, headers=headers, content=body,
                                 extensions={"timeout": self._timeout})
        return await self._transport.handle_async_request(upstream)


class _Queued:
    """A request's seconds of work in an engine's queue; calling it takes them out, once."""

    def __init__(self, engine: UpstreamEngine, seconds: float) -> None:
        self._engine = engine
        self._seconds = seconds
        engine.queued_s += seconds

    def __call__(self) -> None:
        self._engine.queued_s = max(0.0, self._engine.queued_s - self._seconds)
        self._seconds = 0.0


def _closer(engine: UpstreamEngine, aclose: Callable[[], Awaitable[None]],
            dequeue: _Queued) -> Callable[[], None]:
    """The response's ``on_close``: the request leaves the engine's count and queue, its
    connection is closed (or goes back to the pool) whether or not the body was read."""

    def close() -> None:
        engine.in_flight -= 1
        dequeue()
        asyncio.ensure_future(aclose())

    return close
