"""One client connection as the daemon sees it: its replies, what it has not read, its state.

What a connection holds in the daemon's memory is counted here: replies encoded but not yet
handed to the socket, the transport's unsent buffer, and the bodies of frames being received
or not yet processed. The watch (``watch.py``) reads these to cut off slow readers and idle
connections; ``abort`` closes at once, dropping whatever was buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from kvstore.daemon.calls import CallContext
from kvstore.daemon.reply_wire import ReplyWire
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
# Replies up to this size go out as one write (a syscall for the header alone costs ~10 us).
_JOINED_FRAME_BYTES = 64 * 1024


def encode_reply(reply: dict, max_frame_bytes: int) -> list[bytes]:
    """[header, body] of a reply; an error reply instead if it is too large to send."""
    try:
        return proto.encode_frame(reply, max_frame_bytes)
    except proto.ProtocolError as exc:  # e.g. a get whose value outgrew the frame limit
        return proto.encode_frame(proto.error_reply(reply.get("id"), exc.code, exc.message))


class Connection:
    def __init__(self, conn_id: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, max_inflight: int,
                 fd_socket: FdSocket | None = None) -> None:
        self.owner = f"conn-{conn_id}"
        self.reader = reader
        self.writer = writer
        self.wire = ReplyWire(writer)  # every reply's bytes, the loop's and the workers'
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

    # -- what it holds --------------------------------------------------------------------

    def unread_bytes(self) -> int:
        """Reply bytes the client has not taken yet (queued here or in the transport)."""
        transport = self.writer.transport
        buffered = 0 if transport is None or transport.is_closing() else \
            transport.get_write_buffer_size()
        return self._queued_bytes + buffered + self.wire.pending_bytes()

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
        joined = num_bytes <= _JOINED_FRAME_BYTES  # one send, not one per part
        self.held_large = self.held_large or num_bytes > LARGE_BYTES
        self._queued_bytes += num_bytes
        try:
            async with self.write_lock:
                self._queued_bytes -= num_bytes
                num_bytes = 0
                if self.writer.is_closing():
                    return
                if joined:
                    self.wire.write(b"".join(frame))
                else:  # not writelines: it joins header and body into a copy
                    for part in frame:
                        self.wire.write(part)
                frame.clear()
                with contextlib.suppress(ConnectionError):
                    await self.writer.drain()
        finally:
            self._queued_bytes -= num_bytes
            self.last_activity = time.monotonic()

    @property
    def closing(self) -> bool:
        return self.closed_reason is not None or self.writer.is_closing()

    def abort(self, reason: str) -> None:
        """Close now, dropping unsent replies (their memory goes with them)."""
        if self.closed_reason is None:
            self.closed_reason = reason
        for ctx in self.contexts:
            ctx.cancel()
        self.wire.close()  # its duplicate descriptor would keep the socket open
        transport = self.writer.transport
        if transport is not None and not transport.is_closing():
            transport.abort()
