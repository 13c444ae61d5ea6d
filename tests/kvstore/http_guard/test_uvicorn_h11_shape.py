"""What `kvstore/http_guard/connection_guard.py` takes from uvicorn's H11Protocol, which is not
public API.

pyproject.toml pins uvicorn below its next minor release; before the pin is lifted these tests
must pass on the new release. Each failure names what changed, so the guard can follow it:
the class's place, its constructor's keywords (uvicorn's server and the guard both pass them),
the asyncio callbacks the guard forwards, the ``shutdown`` uvicorn calls on the inner protocol,
and the h11 connection (``conn``) whose states tell the guard whether a request is owed.
"""

from __future__ import annotations

import asyncio
import inspect

import h11
import pytest
import uvicorn

from kvstore.http_guard.connection_guard import ConnectionGuard, ConnectionLimits

PIN = "pyproject.toml pins uvicorn below the release that changed it"


def _changed(what: str) -> str:
    return (f"uvicorn {uvicorn.__version__} changed what kvstore/http_guard/connection_guard.py "
            f"relies on: {what}. Adapt the guard before lifting the pin ({PIN}).")


def _h11_protocol() -> type:
    try:
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError as exc:
        pytest.fail(_changed(f"uvicorn.protocols.http.h11_impl.H11Protocol is gone ({exc})"))
    return H11Protocol


def test_the_protocol_class_is_where_the_guard_imports_it() -> None:
    protocol = _h11_protocol()
    assert issubclass(protocol, asyncio.Protocol), _changed("H11Protocol is no asyncio.Protocol")


def test_the_constructor_takes_the_keywords_the_guard_passes() -> None:
    params = inspect.signature(_h11_protocol().__init__).parameters
    missing = {"config", "server_state", "app_state", "_loop"} - set(params)
    assert not missing, _changed(f"H11Protocol.__init__ lost the keyword(s) {sorted(missing)}")


@pytest.mark.parametrize("method", ["connection_made", "data_received", "eof_received",
                                    "connection_lost", "pause_writing", "resume_writing",
                                    "shutdown"])
def test_the_callbacks_the_guard_forwards_are_there(method: str) -> None:
    assert callable(getattr(_h11_protocol(), method, None)), \
        _changed(f"H11Protocol.{method} is gone")


async def _hello(scope, receive, send) -> None:
    """A trivial ASGI app: 200 and a short body."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_real_server_builds_guarded_connections_around_h11_protocols() -> None:
    """uvicorn calls the guard's factory with the keywords it expects, tracks the inner protocol
    for its graceful shutdown, and the inner protocol's ``conn`` says a request is owed while its
    headers are incomplete."""
    protocol = _h11_protocol()

    async def scenario() -> None:
        guard = ConnectionGuard(ConnectionLimits(max_connections=4))
        config = uvicorn.Config(_hello, host="127.0.0.1", port=0, http=guard.protocol_factory,
                                lifespan="off", log_level="warning", loop="asyncio")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        try:
            for _ in range(500):
                if server.started or serving.done():
                    break
                await asyncio.sleep(0.01)
            assert server.started, _changed("a server with http=<factory> did not start")
            port = server.servers[0].sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: test\r\n")  # the headers are not complete
            await writer.drain()
            for _ in range(200):
                if server.server_state.connections:
                    break
                await asyncio.sleep(0.01)
            inner = list(server.server_state.connections)
            assert len(inner) == 1 and isinstance(inner[0], protocol), _changed(
                "the server no longer tracks the H11Protocol inside the guard's connection "
                f"(server_state.connections: {inner!r}); its graceful shutdown would miss it")
            conn = getattr(inner[0], "conn", None)
            assert isinstance(conn, h11.Connection), _changed("H11Protocol.conn is no "
                                                              "h11.Connection")
            assert conn.their_state is h11.IDLE and conn.our_state is h11.IDLE, _changed(
                f"half a request leaves conn in ({conn.their_state}, {conn.our_state})")
            assert guard.num_open == 1
            writer.write(b"\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            assert head.startswith(b"HTTP/1.1 200"), head
            writer.close()
            await writer.wait_closed()
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10.0)

    asyncio.run(scenario())
