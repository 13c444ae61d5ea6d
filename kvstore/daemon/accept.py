"""Accepting connections: a cap on how many are open, and no busy loop when fds run out.

At ``cap`` open connections the acceptor asks ``reclaim`` to close an idle one that holds
nothing (the daemon's choice, ``server.py``) and takes the new one in its place; if none can go,
the new one gets an error frame (``resource_exhausted``, naming the cap) and is closed at once,
so idle connections cannot lock new clients out until the idle timeout. When ``accept`` fails
for lack of file descriptors (EMFILE, ENFILE) or memory, the acceptor spends a spare descriptor
it keeps for this to take the waiting clients one by one and tell them (each gets the same error
frame) instead of leaving them hanging in the backlog, then backs off (50 ms doubling to 1 s)
before accepting again. Its log says so at most once per ``log_interval_s``, with how many
times it happened.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable

from kvstore.rate_limited_log import RateLimitedLog
from kvstore.wire import protocol as proto

log = logging.getLogger("kvstore.daemon.accept")

_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0
_SHED_PER_ROUND = 64


def refusal_frame(message: str) -> bytes:
    return b"".join(proto.encode_frame(proto.error_reply(None, proto.RESOURCE_EXHAUSTED,
                                                         message)))


class Acceptor:
    """Accepts on a listening socket until cancelled; hands each accepted socket on."""

    def __init__(self, sock: socket.socket, cap: int, num_open: Callable[[], int],
                 on_accept: Callable[[socket.socket], None], count: Callable[[str], None],
                 log_interval_s: float = 10.0,
                 reclaim: Callable[[], bool] | None = None) -> None:
        self._sock = sock
        self.cap = cap
        self._num_open = num_open
        self._reclaim = reclaim  # reclaim(): closed an idle connection to make room?
        self._on_accept = on_accept
        self._count = count  # count(event name)
        self._log = RateLimitedLog(log, log_interval_s)
        self._spare_fd: int | None = None
        self._full_frame = refusal_frame(
            f"the daemon has its maximum of {cap} connections open (--max-connections), "
            "none of them idle and free to close for this one; try again later")
        self._out_frame = refusal_frame("the daemon is out of file descriptors; try again "
                                        "later")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        backoff_s = 0.0
        try:
            while True:
                try:
                    conn, _ = await loop.sock_accept(self._sock)
                except OSError as exc:  # never fatal: the daemon must go on accepting
                    if exc.errno in _OUT_OF_RESOURCES:
                        self._count("accept_out_of_resources")
                        self._log.event("out_of_resources", "accept failed: %s; refusing new "
                                        "clients and backing off", exc.strerror)
                        self._shed_waiting()
                    else:
                        self._count("accept_errors")
                        self._log.event(f"accept_failed:{exc.errno}",
                                        "accept failed: %s; backing off", exc)
                    backoff_s = min(_MAX_BACKOFF_S, max(_MIN_BACKOFF_S, 2 * backoff_s))
                    await asyncio.sleep(backoff_s)
                    continue
                backoff_s = 0.0
                if self._num_open() >= self.cap and not (self._reclaim and self._reclaim()):
                    self._count("connections_refused_cap")
                    self._log.event("refused", "connection refused: %d connections open "
                                    "(--max-connections)", self.cap)
                    _refuse(conn, self._full_frame)
                    continue
                self._on_accept(conn)
        finally:
            if self._spare_fd is not None:
                os.close(self._spare_fd)
                self._spare_fd = None

    def _shed_waiting(self) -> None:
        """Out of fds: free the spare one to take waiting clients, tell each, close it."""
        if self._spare_fd is None:  # lost at the last round: take one back if one is free
            try:
                self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return
        os.close(self._spare_fd)
        self._spare_fd = None
        try:
            for _ in range(_SHED_PER_ROUND):
                try:
                    conn, _ = self._sock.accept()
                except OSError:  # none waiting (EAGAIN), or still out of fds
                    break
                self._count("connections_refused_no_fds")
                _refuse(conn, self._out_frame)
        finally:
            try:
                self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._spare_fd = None  # taken meanwhile; tried again next time


def _refuse(conn: socket.socket, frame: bytes) -> None:
    try:
        conn.setblocking(False)
        conn.send(frame)  # a few dozen bytes: the socket buffer takes them
    except OSError:
        pass
    finally:
        conn.close()
