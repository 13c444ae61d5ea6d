"""The HTTP front `kvengine serve` and `kvengine router` both serve through: a listening TCP
socket bound before anything costly starts, the connection bounds fitted to the open-file limit,
and uvicorn run on that socket behind the connection guard until a stop signal, with the
program's ``listening on`` line printed once it listens."""

from __future__ import annotations

import argparse
import logging
import resource
import signal
import socket
from typing import Any

import uvicorn

from kvstore.http_guard.connection_guard import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedServer,
    fit_to_open_files,
)
from kvstore.rate_limited_log import RateLimitedLog
from server.log_setup import BANNER_LOGGER

_BANNER = logging.getLogger(BANNER_LOGGER)


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The connection bounds; the open-file limit is raised as far as the hard limit allows (up
    to 64k), and what it still lacks lowers --max-connections and the accept backlog."""
    wanted = ConnectionLimits(max_connections=args.max_connections,
                              timeout_keep_alive_s=args.timeout_keep_alive,
                              request_read_timeout_s=args.request_read_timeout)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    target = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    limits = fit_to_open_files(wanted, soft)
    if limits.max_connections < wanted.max_connections:
        _BANNER.info("kvengine: the open-file limit is %d: at most %d HTTP connections",
                       soft, limits.max_connections)
    return limits


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _openai_error(status: int, message: str, code: str) -> dict[str, Any]:
    """The guard's own answers (a 503 past the cap, a 408) in the OpenAI error shape."""
    from server.api_error import error_body  # FastAPI's import waits until the app is built

    return error_body(status, message, code=code)


class _Stopped(Exception):
    """A stop signal arrived after uvicorn's graceful shutdown."""


def _raise_stop(signum: int, _frame: Any) -> None:
    raise _Stopped(signum)


class _Server(GuardedServer):
    """uvicorn's server behind the guard, printing our startup line once the socket is bound."""

    def __init__(self, config: uvicorn.Config, line: Any, guard: ConnectionGuard) -> None:
        super().__init__(config, guard)
        self._line = line

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            if self.servers and self.servers[0].sockets:
                port = self.servers[0].sockets[0].getsockname()[1]
            _BANNER.info("%s", self._line(port))


def run_app(app: Any, args: argparse.Namespace, limits: ConnectionLimits,
             listener: socket.socket, line: Any) -> int:
    """Serve ``app`` on ``listener`` until a stop signal; ``line(port)`` is printed once it
    listens. 0 if it served, 1 if it did not start."""
    guard = ConnectionGuard(limits, RateLimitedLog(logging.getLogger("kvengine.server")),
                            error_shape=_openai_error)
    uv_level = args.uvicorn_log_level or args.log_level
    # log_config None: uvicorn's loggers propagate to the handler configure_logging set up.
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=uv_level,
                               log_config=None, root_path=getattr(args, "root_path", ""),
                               access_log=uv_level in ("info", "debug", "trace"),
                               timeout_graceful_shutdown=5, http=guard.protocol_factory,
                               # asyncio's loop, also where uvloop is installed: the
                               # connection guard's refusals and bounds are built and tested
                               # on it (on uvloop no connection past the cap got its 503)
                               loop="asyncio",
                               timeout_keep_alive=max(1, round(limits.timeout_keep_alive_s)),
                               backlog=limits.accept_backlog)
    server = _Server(uv_config, line, guard)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal; our handler
    # turns that into an exception so the caller's cleanup runs (the engine's KV arena freed).
    previous = {sig: signal.signal(sig, _raise_stop) for sig in _STOP_SIGNALS}
    try:
        server.run(sockets=[listener])
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host is one); OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and without it every response waited ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
