"""ReplyWire: a connection's outgoing bytes, written by the event loop or by a worker thread.

The loop writes replies through the asyncio transport. A worker that has just finished a copy
verb may write its reply itself, on a duplicate of the connection's socket, instead of waking
the loop to do it: on an H100 host the worker-to-loop hop and the loop's encode and write cost
~0.19 ms of a 64-block load's ~3.7 ms (``benchmarks/request_trace.py``). Frames stay whole: every
write takes the wire's lock, a worker writes only when the transport holds no unsent bytes (so
no frame of the loop's is half out), and a worker's frame the socket took only in part leaves
its tail to be written first, before any other frame (the loop writes it at its next turn).

The duplicate descriptor is the wire's own, made on the loop the first time a copy verb comes
(``open_for_workers``): it is closed by ``close`` (under the lock), so its number is never
reused by another connection while a worker may still write on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading


class ReplyWire:
    """Create it on the loop's thread, with the connection's writer."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._tail = b""  # a worker's frame the socket took only in part: the rest goes first
        self._sock: socket.socket | None = None  # the duplicate, once a worker may write
        self._closed = False
        self.worker_writes = 0  # replies a worker wrote itself
        self.worker_declined = 0  # replies a worker left to the loop (transport busy, closed)

    def open_for_workers(self) -> None:
        """On the loop, before a worker may write: the duplicate descriptor, made once (a
        connection that never runs a copy verb holds one descriptor, not two). Without one
        (closed, out of descriptors) every write is the loop's."""
        if self._sock is not None or self._closed or self._writer.is_closing():
            return
        sock = self._writer.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return
        with contextlib.suppress(OSError):  # out of descriptors: the loop writes them all
            dup = socket.socket(fileno=os.dup(sock.fileno()))
            with self._lock:
                if self._closed:
                    dup.close()
                else:
                    self._sock = dup

    def pending_bytes(self) -> int:
        """A worker's frame's tail not yet written (counted as unread by the client)."""
        return len(self._tail)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """On the loop: ``data`` after any tail, through the transport."""
        with self._lock:
            self._write_tail()
            self._writer.write(data)

    def write_from_worker(self, data: bytes) -> bool:
        """On a worker: ``data`` (one whole frame) straight onto the socket if nothing of the
        transport's is waiting; True once the frame is the connection's (all of it sent, or its
        tail left for the loop), False when the caller must hand it to the loop instead."""
        with self._lock:
            transport = self._writer.transport
            if (self._sock is None or self._tail or transport is None
                    or transport.is_closing() or transport.get_write_buffer_size()):
                self.worker_declined += 1
                return False
            try:
                sent = self._sock.send(data, socket.MSG_DONTWAIT)
            except OSError:  # full (EAGAIN), or the peer is gone: the loop finds out
                self.worker_declined += 1
                return False
            self.worker_writes += 1
            if sent < len(data):
                self._tail = bytes(data[sent:])
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads on
                    self._loop.call_soon_threadsafe(self._flush)
            return True

    def _flush(self) -> None:
        with self._lock:
            self._write_tail()

    def _write_tail(self) -> None:
        """Hand a worker's tail to the transport (the lock held, on the loop)."""
        if self._tail:
            tail, self._tail = self._tail, b""
            if not self._writer.is_closing():
                self._writer.write(tail)

    def close(self) -> None:
        """No worker writes any more; the duplicate descriptor is closed. Idempotent."""
        with self._lock:
            sock, self._sock = self._sock, None
            self._tail, self._closed = b"", True
        if sock is not None:
            sock.close()
