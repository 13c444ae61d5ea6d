"""ConnectionGuard: a cap on open HTTP connections and a deadline on every request's arrival.

uvicorn alone keeps a connection that never sends a request, or sends half a body, open forever
(its keep-alive timer only starts after a response, and any byte stops it), and accepts until the
process runs out of file descriptors. Its `limit_concurrency` does not help: it answers 503 on
connections it has already accepted and never closes idle ones. The guard wraps each of
uvicorn's h11 connections (composition: the h11 protocol does the HTTP) and

- refuses a connection past `max_connections` at once (a 503, then close), so the process keeps
  descriptors for its own files and for the clients it serves;
- closes a connection that owes the server a request (no request yet, headers or body
  incomplete, or the rest of a refused upload) for longer than a bound: `timeout_keep_alive_s`
  while not a byte of it came, `request_read_timeout_s` once some did (a 408 if nothing was
  answered yet). A request fully read is never timed out here: generating can take long.

Events are logged at most once per interval per kind, also asyncio's own "socket.accept() out of
system resource" (which it logs with a traceback for every failed accept of a burst, and then
retries: megabytes of log a second once descriptors run out).

uvicorn's `H11Protocol` is not its public API: pyproject.toml pins uvicorn below its next minor
release, and tests/kvstore/http_guard/test_uvicorn_h11_shape.py names what changed if a newer
one moves it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvstore.rate_limited_log import RateLimitedLog

logger = logging.getLogger("kvstore.http_guard")

# (status, message, code) -> the JSON body of the guard's own answers (a 503, a 408)
ErrorShape = Callable[[int, str, str], dict[str, Any]]


def plain_error(status: int, message: str, code: str) -> dict[str, Any]:
    """``{"error": {"message", "code"}}``: the guard's answers where the app has no shape."""
    return {"error": {"message": message, "code": code}}


def _raw_response(status: int, reason: str, body: dict[str, Any]) -> bytes:
    """A whole HTTP/1.1 response with a JSON body that closes the connection."""
    data = json.dumps(body).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"connection: close\r\ncontent-length: {len(data)}\r\n\r\n")
    return head.encode() + data


FDS_KEPT_FOR_THE_PROCESS = 64  # model files, shared memory, the store's socket, device nodes
MAX_ACCEPT_BACKLOG = 2048  # uvicorn's default
_ACCEPT_MESSAGE = "socket.accept() out of system resource"  # asyncio's, for EMFILE and the like


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds on HTTP connections; validated once. `accept_backlog` is the listen backlog, and
    also how many connections asyncio accepts at one wake-up before any of them is refused."""

    max_connections: int = 1024
    timeout_keep_alive_s: float = 5.0
    request_read_timeout_s: float = 30.0
    accept_backlog: int = MAX_ACCEPT_BACKLOG

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.accept_backlog < 1:
            raise ValueError(f"accept_backlog must be >= 1, got {self.accept_backlog}")
        for name, value in (("timeout_keep_alive_s", self.timeout_keep_alive_s),
                            ("request_read_timeout_s", self.request_read_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    @property
    def tick_s(self) -> float:
        """How often deadlines are checked: a small part of the shortest bound."""
        return min(1.0, self.timeout_keep_alive_s / 4, self.request_read_timeout_s / 4)


def fit_to_open_files(limits: ConnectionLimits, max_open_files: int) -> ConnectionLimits:
    """`limits` with the backlog and the connection cap lowered to what `max_open_files` leaves:
    admitted connections, plus up to three accept bursts of refused ones (a refused socket holds
    its descriptor for a few turns of the loop), plus the process's own files."""
    budget = max(4, max_open_files - FDS_KEPT_FOR_THE_PROCESS)
    backlog = max(1, min(limits.accept_backlog, budget // 8))
    max_connections = max(1, min(limits.max_connections, budget - 3 * backlog))
    return ConnectionLimits(max_connections, limits.timeout_keep_alive_s,
                            limits.request_read_timeout_s, backlog)


class GuardedConnection(asyncio.Protocol):
    """One TCP connection: uvicorn's h11 protocol inside, the guard's bookkeeping around it."""

    def __init__(self, guard: ConnectionGuard, inner: H11Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._transport: Any = None  # asyncio's or uvloop's transport
        self._admitted = False
        self.owing_since: float | None = None  # when it began to owe a request (None: it does not)
        self.bytes_while_owing = 0

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        # An asyncio.Transport in duck type only: uvloop's TCPTransport (uvicorn's loop whenever
        # uvloop is installed) is no subclass of it.
        self._transport = transport
        if not self._guard.admit(self):
            transport.write(self._guard.refusal)
            transport.close()
            return
        self._admitted = True
        self.owing_since = time.monotonic()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return  # refused: the transport is closing
        self._inner.data_received(data)
        if not self.owes_request():
            self.owing_since = None  # a whole request arrived: no deadline while it is served
            return
        if self.owing_since is None:  # the first bytes of the next request on a kept connection
            self.owing_since, self.bytes_while_owing = time.monotonic(), 0
        self.bytes_while_owing += len(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._guard.discard(self)
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    # ---- the guard's view ------------------------------------------------------------------------
    def owes_request(self) -> bool:
        """True while the client has not sent a whole request: none yet (a fresh or kept-alive
        connection), or its headers or body are incomplete (also after an early answer)."""
        return self._inner.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def deadline_passed(self, now: float, limits: ConnectionLimits) -> bool:
        """Refresh the owing state and say whether the connection is past its bound."""
        if not self.owes_request():
            self.owing_since = None
            return False
        if self.owing_since is None:
            self.owing_since, self.bytes_while_owing = now, 0
            return False
        bound = (limits.request_read_timeout_s if self.bytes_while_owing
                 else limits.timeout_keep_alive_s)
        return now - self.owing_since > bound

    def close_timed_out(self) -> None:
        """Close; a client that began a request and got no answer yet gets a 408 first."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        # IDLE: headers incomplete; SEND_RESPONSE: a request came, no byte of an answer yet.
        if self.bytes_while_owing and self._inner.conn.our_state in (h11.IDLE,
                                                                     h11.SEND_RESPONSE):
            transport.write(self._guard.late_answer)
        transport.close()


class ConnectionGuard:
    """Builds uvicorn's connection protocols (`protocol_factory` as `uvicorn.Config(http=...)`)
    and enforces `limits` on them from one timer on the event loop."""

    def __init__(self, limits: ConnectionLimits, log: RateLimitedLog | None = None,
                 error_shape: ErrorShape = plain_error, cap_flag: str = "--max-connections",
                 timeout_flags: str = "--timeout-keep-alive, --request-read-timeout",
                 on_event: Callable[[str], None] | None = None) -> None:
        """``cap_flag`` / ``timeout_flags``: the program's names of the limits, for its log
        lines ("" for bounds no flag sets); ``on_event``: told ``refused``, ``timed_out`` or
        ``idle_closed`` as each happens (the program's counters)."""
        self.limits = limits
        self._log = log or RateLimitedLog(logger)
        self._cap_flag = cap_flag
        self._timeout_flags = f"; {timeout_flags}" if timeout_flags else ""
        self._on_event = on_event or (lambda _kind: None)
        self.refusal = _raw_response(503, "Service Unavailable", error_shape(
            503, "too many open connections; retry later", "overloaded"))
        self.late_answer = _raw_response(408, "Request Timeout", error_shape(
            408, "the request did not arrive in time", "request_timeout"))
        self._live: set[GuardedConnection] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.num_refused = 0
        self.num_timed_out = 0  # began a request and did not finish it in time
        self.num_idle_closed = 0  # sent nothing in time (a normal keep-alive expiry among them)

    @property
    def num_open(self) -> int:
        """Connections admitted and not closed yet."""
        return len(self._live)

    def protocol_factory(self, config: Any, server_state: Any, app_state: dict[str, Any],
                         _loop: asyncio.AbstractEventLoop | None = None) -> GuardedConnection:
        """What uvicorn calls for every accepted connection."""
        inner = H11Protocol(config=config, server_state=server_state, app_state=app_state,
                            _loop=_loop)
        return GuardedConnection(self, inner)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Route asyncio's accept-failure reports on `loop` through the rate-limited log."""
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if context.get("message") == _ACCEPT_MESSAGE:
                self._log.event("accept_failed", f"cannot accept a connection: "
                                f"{context.get('exception')!r}", level=logging.ERROR)
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)

    def admit(self, connection: GuardedConnection) -> bool:
        """Take `connection` into account, or refuse it (False) when the cap is reached."""
        if len(self._live) >= self.limits.max_connections:
            self.num_refused += 1
            self._on_event("refused")
            self._log.event("refused", f"refused a connection: {len(self._live)} are open, "
                            f"the limit is {self.limits.max_connections} ({self._cap_flag})")
            return False
        self._live.add(connection)
        if self._timer is None:
            self._schedule()
        return True

    def discard(self, connection: GuardedConnection) -> None:
        """`connection` closed."""
        self._live.discard(connection)

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.limits.tick_s, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        now = time.monotonic()
        for connection in list(self._live):
            if not connection.deadline_passed(now, self.limits):
                continue
            if not connection.bytes_while_owing:
                self.num_idle_closed += 1
                self._on_event("idle_closed")
            else:
                self.num_timed_out += 1
                self._on_event("timed_out")
                self._log.event("timed_out", "closed a connection that did not send a whole "
                                f"request in time ({self.limits.timeout_keep_alive_s:g} s idle, "
                                f"{self.limits.request_read_timeout_s:g} s for a request"
                                f"{self._timeout_flags})")
            connection.close_timed_out()
        if self._live:
            self._schedule()


class GuardedServer(uvicorn.Server):
    """uvicorn's server whose loop reports failed accepts through the guard's log (build its
    ``uvicorn.Config`` with ``http=guard.protocol_factory``)."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard

    async def startup(self, sockets: list | None = None) -> None:
        self.guard.install(asyncio.get_running_loop())
        await super().startup(sockets)
