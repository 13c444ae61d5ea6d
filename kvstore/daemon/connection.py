"""One client connection as the daemon sees it: its replies, what it has not read, its state.

What a connection holds in the daemon's memory is counted here: replies encoded but not yet
handed to the socket, the transport's unsent buffer, and the bodies of frames being received
or not yet processed. The watch (``watch.py``) reads these to cut off slow readers and idle
connections; ``abort`` closes at once, dropping whatever was buffered.

A worker that ran a call may write its small reply straight to the socket (``send_now``,
``direct_reply.py``) instead of handing it back to the loop, which costs a thread hop and a few
loop turns per request. Bytes of two replies never interleave: every write to the socket, the
loop's and a worker's, runs under one lock, and a worker writes only while the transport holds
nothing unsent; what the socket did not take of its reply (``_tail``) the loop writes before
anything else. A worker writes through its own duplicate of the socket's descriptor, closed
under that lock, so it never writes to a descriptor number the transport closed and the
process reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time

from kvstore.daemon.calls import CallContext
from kvstore.wire import protocol as proto
from kvstore.wire.fds import NO_FDS, FdSocket, FrameFds

# Verbs whose replies carry bulk data (a get's value): a connection runs one at a time, holding
# its slot until the reply is written out, so one that does not read holds one value in memory,
# never one per request in flight.
BULK_REPLY_VERBS = frozenset({"get"})
BULK_SLOTS_PER_CONNECTION = 1
# Verbs that take file descriptors with their frame (``wire/fds.py``): the memory they register.
FD_VERBS = frozenset({"register"})
LARGE_BYTES = 1 << 20


def encode_reply(reply: dict, max_frame_bytes: int) -> list[bytes]:
    """[header, body] of a reply; an error reply instead if it is too large to send."""
    try:
        return proto.encode_frame(reply, max_frame_bytes)
    except proto.ProtocolError as exc:  # e.g. a get whose value outgrew the frame limit
        return proto.encode_frame(proto.error_reply(reply.get("id"), exc.code, exc.message))


class Connection:
    def __init__(self, conn_id: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, max_inflight: int,
                 fd_socket: FdSocket | None = None, direct_replies: bool = False) -> None:
        self.owner = f"conn-{conn_id}"
        self.reader = reader
        self.writer = writer
        self.fd_socket = fd_socket  # its reads take the descriptors sent with frames
        self._frames_end = 0  # stream bytes the frame loop has read: where the next frame starts
        self.slots = asyncio.Semaphore(max_inflight)
        self.bulk_slots = asyncio.Semaphore(BULK_SLOTS_PER_CONNECTION)
        self.write_lock = asyncio.Lock()
        self.contexts: set[CallContext] = set()
        self.tasks: set[asyncio.Task] = set()
        self.body_bytes = 0  # frames being received or not yet processed
        self.last_activity = time.monotonic()  # a frame arrived or a reply went out
        self.closed_reason: str | None = None
        self.held_large = False  # a large frame or reply passed: release memory at close
        self._queued_bytes = 0  # encoded replies waiting for the write lock
        self._unread_since: float | None = None
        self._last_unread = 0
        self._wire_lock = threading.Lock()  # every write to the socket, loop's and workers'
        self._tail: bytes | None = None  # a worker's reply the socket did not take whole
        self._loop = asyncio.get_running_loop()
        # A worker's own descriptor of the socket (``send_now``), made by ``open_direct`` on the
        # loop's thread; None: replies go by the loop.
        self._direct: socket.socket | None = None
        self._direct_wanted = direct_replies and fd_socket is not None

    # -- what it holds --------------------------------------------------------------------

    def unread_bytes(self) -> int:
        """Reply bytes the client has not taken yet (queued here or in the transport)."""
        return self._queued_bytes + self._transport_bytes()

    def _transport_bytes(self) -> int:
        transport = self.writer.transport
        return 0 if transport is None or transport.is_closing() else \
            transport.get_write_buffer_size()

    def buffered_bytes(self) -> int:
        return self.unread_bytes() + self.body_bytes

    def is_idle(self) -> bool:
        return not self.tasks and self.body_bytes == 0 and self.unread_bytes() == 0

    def stalled_for(self, now: float) -> float:
        """Seconds its unread replies have not shrunk (0 when it has none); call each tick."""
        unread = self.unread_bytes()
        if unread == 0:
            self._unread_since = None
        elif self._unread_since is None or unread < self._last_unread:
            self._unread_since = now
        self._last_unread = unread
        return 0.0 if self._unread_since is None else now - self._unread_since

    # -- descriptors sent with frames -----------------------------------------------------

    def claim_fds(self, body_bytes: int) -> FrameFds:
        """The descriptors sent with the frame just read (its header and ``body_bytes``);
        FdError if they came otherwise or past the connection's bound (``wire/fds.py``)."""
        start = self._frames_end
        self._frames_end += proto.HEADER_BYTES + body_bytes
        if self.fd_socket is None:
            return NO_FDS
        return self.fd_socket.claim(start, self._frames_end)

    # -- replies and closing --------------------------------------------------------------

    async def send(self, reply: dict, max_frame_bytes: int) -> None:
        await self.send_frame(encode_reply(reply, max_frame_bytes))

    async def send_frame(self, frame: list[bytes]) -> None:
        """Write one encoded reply (taking it: the caller keeps no reference, so its memory
        goes as soon as the transport has copied or sent it)."""
        num_bytes = sum(len(part) for part in frame)
        self.held_large = self.held_large or num_bytes > LARGE_BYTES
        self._queued_bytes += num_bytes
        try:
            async with self.write_lock:
                self._queued_bytes -= num_bytes
                num_bytes = 0
                if self.writer.is_closing():
                    return
                with self._wire_lock:
                    self._write_tail()
                    for part in frame:  # not writelines: it joins header and body into a copy
                        self.writer.write(part)
                frame.clear()
                with contextlib.suppress(ConnectionError):
                    await self.writer.drain()
        finally:
            self._queued_bytes -= num_bytes
            self.last_activity = time.monotonic()

    def open_direct(self) -> None:
        """On the loop's thread, before a worker runs this connection's first call: its own
        descriptor of the socket (once; a process out of descriptors keeps replying by the
        loop). The loop's thread, because only it closes the transport's descriptor."""
        if not self._direct_wanted or self.closing:
            return
        self._direct_wanted = False
        try:
            direct = socket.socket(fileno=os.dup(self.fd_socket.fileno()))
        except OSError:
            return
        with self._wire_lock:
            self._direct = direct

    def send_now(self, frame: list[bytes]) -> bool:
        """From a worker thread: write a reply straight to the socket; False (nothing written)
        when the loop must send it: the connection is closing, the transport still holds
        unsent bytes, or the socket takes none now. What the socket does not take whole, the
        loop writes next (``_tail``)."""
        data = b"".join(frame)
        with self._wire_lock:
            if self._direct is None or self.closing or self._tail is not None \
                    or self._transport_bytes():
                return False
            try:
                sent = self._direct.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError:  # full (EAGAIN) or gone: the loop's write finds out which
                return False
            self.last_activity = time.monotonic()
            if sent < len(data):
                self._tail = data[sent:]
                self._queued_bytes += len(self._tail)
                with contextlib.suppress(RuntimeError):  # the loop is gone: so is the client
                    self._loop.call_soon_threadsafe(self._flush_tail)
            return True

    def _flush_tail(self) -> None:
        with self._wire_lock:
            self._write_tail()

    def _write_tail(self) -> None:
        """The rest of a worker's reply into the transport (the loop's thread, the lock held)."""
        tail, self._tail = self._tail, None
        if tail is not None:
            self._queued_bytes -= len(tail)
            if not self.writer.is_closing():
                self.writer.write(tail)

    def close_direct(self) -> None:
        """No worker writes to the socket any more (its descriptor closed)."""
        with self._wire_lock:
            direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()

    @property
    def closing(self) -> bool:
        return self.closed_reason is not None or self.writer.is_closing()

    def abort(self, reason: str) -> None:
        """Close now, dropping unsent replies (their memory goes with them)."""
        with self._wire_lock:  # no worker writes a reply after this
            if self.closed_reason is None:
                self.closed_reason = reason
        for ctx in self.contexts:
            ctx.cancel()
        transport = self.writer.transport
        if transport is not None and not transport.is_closing():
            transport.abort()
