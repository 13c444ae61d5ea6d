"""Headers a message's ``Connection`` header names are hop-by-hop for that message: the router
forwards neither the request's to the engine nor the engine's back (RFC 9110 7.6.1). Attacked
from outside (2026-11-28): ``Connection: X-Secret`` with ``X-Secret: ...`` passed both ways."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from starlette.requests import Request

from server.router.proxy import PassThroughResponse, RouterProxy, connection_named


def test_the_names_a_connection_header_lists() -> None:
    raw = [(b"Connection", b"keep-alive, X-Secret"), (b"connection", b"  x-other ,"),
           (b"X-Secret", b"1")]
    assert connection_named(raw) == {b"keep-alive", b"x-secret", b"x-other"}
    assert connection_named([(b"Host", b"a")]) == frozenset()


def test_neither_way_passes_a_header_the_connection_header_names() -> None:
    seen: list[httpx.Request] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"Connection": "X-Internal", "X-Internal": "db=2",
                                            "X-Kept": "yes"}, content=b"{}")

    proxy = RouterProxy(httpx.MockTransport(engine), httpx.Timeout(5.0), pool=None,
                        metrics=None)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"host", b"router"), (b"connection", b"X-Secret"),
                         (b"x-secret", b"token"), (b"authorization", b"Bearer k")]}
    request = Request(scope)
    upstream = asyncio.run(proxy._send(SimpleNamespace(url="http://engine:1"), request, b"{}"))
    sent = {name.lower() for name, _ in seen[0].headers.raw}
    assert b"x-secret" not in sent and b"connection" not in sent
    assert b"authorization" in sent
    response = PassThroughResponse(upstream, "http://engine:1", lambda: None, lambda e: None,
                                   lambda: None)
    returned = {name.lower() for name, _ in response.raw_headers}
    assert b"x-internal" not in returned and b"x-kept" in returned
