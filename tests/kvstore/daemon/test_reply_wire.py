"""ReplyWire over a real socket pair and asyncio transport: a worker's frame the socket takes only
in part has its tail written before any later frame, and a closed wire writes nothing."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from kvstore.daemon.reply_wire import ReplyWire

pytestmark = pytest.mark.timeout(60)


def _fill(sock: socket.socket) -> int:
    """Bytes written into ``sock``'s peer until the kernel takes no more."""
    filler = socket.socket(fileno=os.dup(sock.fileno()))
    sent = 0
    try:
        while True:
            try:
                sent += filler.send(b"f" * 4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return sent
    finally:
        filler.close()


def _read_all(sock: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    sock.settimeout(10)
    while len(data) < num_bytes:
        chunk = sock.recv(1 << 16)
        assert chunk, "the wire closed early"
        data += chunk
    return bytes(data)


def test_a_partly_sent_frame_keeps_its_place() -> None:
    async def scenario() -> None:
        ours, peer = socket.socketpair()
        _, writer = await asyncio.open_unix_connection(sock=ours)
        wire = ReplyWire(writer)
        wire.open_for_workers()
        filled = _fill(ours)
        peer.recv(8192)  # room for a little of the next frame, not all of it
        frame = bytes(range(256)) * 256  # 64 KiB
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, wire.write_from_worker, frame)
        # the socket took part; the rest is written first, by the loop (at its next turn)
        assert wire.worker_writes == 1
        assert wire.pending_bytes() + writer.transport.get_write_buffer_size() > 0
        wire.write(b"END")  # a later frame of the loop's
        got = await loop.run_in_executor(None, _read_all, peer,
                                         filled - 8192 + len(frame) + 3)
        assert got[filled - 8192:] == frame + b"END"
        assert wire.pending_bytes() == 0
        wire.close()
        writer.close()
        peer.close()

    asyncio.run(scenario())


def test_a_worker_leaves_its_frame_to_the_loop_behind_unsent_bytes_or_once_closed() -> None:
    async def scenario() -> None:
        ours, peer = socket.socketpair()
        _, writer = await asyncio.open_unix_connection(sock=ours)
        wire = ReplyWire(writer)
        assert not wire.write_from_worker(b"x")  # no duplicate yet: the loop writes
        wire.open_for_workers()
        _fill(ours)
        wire.write(b"y" * 65536)  # the transport keeps what the socket cannot take
        assert writer.transport.get_write_buffer_size() > 0
        assert not wire.write_from_worker(b"z")
        wire.close()
        assert not wire.write_from_worker(b"z")
        assert wire.worker_declined == 3 and wire.worker_writes == 0
        writer.transport.abort()
        peer.close()

    asyncio.run(scenario())
