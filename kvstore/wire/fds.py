"""File descriptors passed with a frame over the Unix socket (``SCM_RIGHTS``): proof of possession.

A client that registers memory sends the memory's file descriptors (anonymous ``memfd``s) with
the frame, never a name another process could open. The wire rule: the descriptors ride on one
``sendmsg`` whose bytes are the first bytes of their frame and of that frame only (the client
sends the 4-byte header that way, the rest of the frame as usual). At most
``MAX_FDS_PER_FRAME`` descriptors go with one frame.

The daemon reads its connections through asyncio streams, whose transport calls the socket's
``recv``; ``FdSocket`` is the accepted socket with ``recv``/``recv_into`` made ``recvmsg``, so
the transport reads the ancillary data too. The kernel ends a read right after the bytes that
carried descriptors, so the descriptors of one read belong to the frame holding the read's last
byte, and that frame must start inside the read (else they did not come with a frame's first
bytes, and the connection is refused; a client that breaks the rule inside one read has them
bound to that frame, which concerns nobody but itself: descriptors never leave the connection
that sent them). ``FdSocket`` remembers each read that brought descriptors with its byte range
in the stream; the frame loop claims them per frame (``claim``). What a connection holds
(received and not yet closed) is bounded by ``max_fds``: past it, or when the kernel had to
drop descriptors (``MSG_CTRUNC``: too many in one message, or the daemon out of descriptors),
every descriptor it holds unclaimed is closed and the next claim fails, which refuses the
connection.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.wire.framing import MALFORMED_FRAME, RESOURCE_EXHAUSTED

MAX_FDS_PER_FRAME = 16
MAX_FDS_PER_CONNECTION = 64
_FD_BYTES = array.array("i").itemsize


class FdError(Exception):
    """Descriptors that cannot be bound to a frame, or a connection past its bound; ``code`` is
    the protocol code the connection is refused with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def send_with_fds(sock: socket.socket, frame: Sequence[bytes], fds: Sequence[int]) -> None:
    """Send ``frame`` (header, body) on a blocking socket, ``fds`` with its first bytes."""
    if len(fds) > MAX_FDS_PER_FRAME:
        raise ValueError(f"{len(fds)} file descriptors for one frame; at most "
                         f"{MAX_FDS_PER_FRAME}")
    header = frame[0]
    if not fds:
        sent = 0
    else:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([header], rights)
    if sent < len(header):  # a signal cut the first send short: the rest has no descriptors
        sock.sendall(header[sent:])
    for part in frame[1:]:
        sock.sendall(part)


class FrameFds:
    """The descriptors that came with one frame, now the daemon's: ``close()`` (idempotent)
    once nothing can use them any more; a mapping made from one keeps its memory."""

    def __init__(self, fds: Sequence[int] = (),
                 on_close: Callable[[int], None] | None = None) -> None:
        self.numbers = tuple(fds)
        self._on_close = on_close
        self._closed = not self.numbers

    def __len__(self) -> int:
        return len(self.numbers)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in self.numbers:
            _close(fd)
        if self._on_close is not None:
            self._on_close(len(self.numbers))


NO_FDS = FrameFds()


@dataclass(frozen=True)
class _Arrival:
    """Descriptors one read brought, with the stream bytes [start, end) that read returned."""

    start: int
    end: int
    fds: tuple[int, ...]


class FdSocket(socket.socket):
    """An accepted Unix stream socket whose reads also take descriptors (see the module
    docstring); every method runs on the event loop's thread."""

    max_fds = MAX_FDS_PER_CONNECTION

    @classmethod
    def adopt(cls, sock: socket.socket, max_fds: int = MAX_FDS_PER_CONNECTION) -> FdSocket:
        """``sock`` as an FdSocket (the same connection; ``sock`` is detached)."""
        fd_sock = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        fd_sock.max_fds = max_fds
        return fd_sock

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stream_bytes = 0  # bytes read from the stream so far
        self._arrivals: deque[_Arrival] = deque()
        self._num_held = 0  # received and not yet closed: unclaimed or claimed
        self._error: FdError | None = None
        self._space = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * _FD_BYTES)

    # -- the transport's reads ---------------------------------------------------------------

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data, ancdata, msg_flags, _ = self.recvmsg(bufsize, self._space,
                                                   flags | socket.MSG_CMSG_CLOEXEC)
        self._arrived(len(data), ancdata, msg_flags)
        return data

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        got, ancdata, msg_flags, _ = self.recvmsg_into([view], self._space,
                                                       flags | socket.MSG_CMSG_CLOEXEC)
        self._arrived(got, ancdata, msg_flags)
        return got

    def _arrived(self, num_bytes: int, ancdata: list, msg_flags: int) -> None:
        start = self.stream_bytes
        self.stream_bytes += num_bytes
        fds: list[int] = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(data[:len(data) - len(data) % _FD_BYTES])
                fds.extend(got)
        if not fds and not msg_flags & socket.MSG_CTRUNC:
            return
        self._num_held += len(fds)
        if msg_flags & socket.MSG_CTRUNC:
            self._fail(fds, FdError(RESOURCE_EXHAUSTED, f"more than {MAX_FDS_PER_FRAME} file "
                                    "descriptors in one message, or the daemon is out of them"))
        elif self._error is not None:
            self._drop(fds)
        elif self._num_held > self.max_fds:
            self._fail(fds, FdError(RESOURCE_EXHAUSTED, f"the connection sent more than "
                                    f"{self.max_fds} file descriptors not yet used"))
        else:
            self._arrivals.append(_Arrival(start, self.stream_bytes, tuple(fds)))

    # -- the frame loop ----------------------------------------------------------------------

    def claim(self, start: int, end: int) -> FrameFds:
        """The descriptors sent with the frame at stream bytes [start, end) (``NO_FDS`` if
        none), the caller's to close; FdError (the connection should be refused) if
        descriptors came otherwise than with a frame's first bytes, or past a bound."""
        if self._error is not None:
            raise self._error
        found: list[_Arrival] = []
        while self._arrivals and self._arrivals[0].end <= end:
            found.append(self._arrivals.popleft())
        if not found:
            return NO_FDS
        if len(found) > 1 or not found[0].start <= start < found[0].end:
            self._fail([fd for a in found for fd in a.fds],
                       FdError(MALFORMED_FRAME, "file descriptors must come with the first "
                               "bytes of their frame, once per frame"))
            raise self._error
        return FrameFds(found[0].fds, self._released)

    def close_unclaimed(self) -> None:
        """Close every descriptor received and not claimed (the connection is closing)."""
        while self._arrivals:
            self._drop(self._arrivals.popleft().fds)

    def _released(self, num_fds: int) -> None:
        self._num_held -= num_fds

    def _fail(self, fds: list[int], error: FdError) -> None:
        if self._error is None:
            self._error = error
        self._drop(fds)
        self.close_unclaimed()

    def _drop(self, fds: Sequence[int]) -> None:
        for fd in fds:
            _close(fd)
        self._num_held -= len(fds)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
