"""Reading one frame's body off a connection without stalling the daemon's other clients.

``StreamReader.readexactly`` gathers a body whole in the reader's buffer and then copies it out
in one C call: for a 96 MB frame (a chain of a million blocks) those copies held the GIL, so the
event loop and every other connection, for ~0.1 s (measured with py-spy, ``--gil``). A large
body instead lands piece by piece, as it arrives, in an anonymous mapping whose pages the kernel
supplies as they are first written: no step copies more than a piece.

What a body holds is counted as it arrives (``room``), not as its header announces: a header
that announced 256 MiB and sent nothing more took the daemon's whole buffer budget for the
frame timeout, and four of them, renewed as they timed out, kept every other client's large
frame waiting or refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

PIECE_BYTES = 1 << 20  # the most one read copies (the reader's buffer holds less, usually)

# ``room(n)``: count ``n`` more bytes of the body as held, first waiting while the budget is spent
Room = Callable[[int], Awaitable[None]]


class NoRoom(TimeoutError):
    """A frame's body waited for buffer budget until its deadline."""


async def _no_budget(_num_bytes: int) -> None:
    return None


async def read_body(reader: asyncio.StreamReader, length: int, small_max: int,
                    room: Room | None = None, give_up_at: float | None = None
                    ) -> bytes | memoryview:
    """The next ``length`` bytes: ``bytes`` up to ``small_max``, else a memoryview of a private
    mapping filled a piece at a time. With ``room``, each piece is counted by it before it is
    read (``_pieces``). Every read is bounded by ``give_up_at`` (``time.monotonic()``; None:
    unbounded): TimeoutError past it (NoRoom from ``room``). IncompleteReadError if the peer goes
    away first (its ``partial`` is left empty: nobody reads a torn frame)."""
    if length <= small_max and room is None:
        return await _bounded(reader.readexactly(length), give_up_at)
    pieces = _pieces(reader, length, room or _no_budget, give_up_at)
    if length <= small_max:
        return b"".join([piece async for piece in pieces])
    view = memoryview(mmap.mmap(-1, length))
    got = 0
    async for piece in pieces:
        view[got:got + len(piece)] = piece
        got += len(piece)
    return view


async def _bounded(awaitable: Awaitable[bytes], give_up_at: float | None) -> bytes:
    if give_up_at is None:
        return await awaitable
    left_s = max(0.0, give_up_at - time.monotonic())
    if sys.version_info < (3, 11):  # no asyncio.timeout
        return await asyncio.wait_for(awaitable, left_s)
    # A scope on this task, not wait_for's (before 3.12) task per read: a request's body is
    # most often in the buffer already, and a task costs the loop more turns than the read.
    async with asyncio.timeout(left_s):
        return await awaitable


async def _pieces(reader: asyncio.StreamReader, length: int, room: Room,
                  give_up_at: float | None) -> AsyncIterator[bytes]:
    """The body a piece at a time, each counted by ``room`` before it is read (what a read
    returns short of the piece stays counted for the next): what is held never passes what is
    counted, and the count ends at ``length``."""
    got = counted = 0
    while got < length:
        want = min(length - got, PIECE_BYTES)
        if counted < want:
            await room(want - counted)
            counted = want
        piece = await _bounded(reader.read(want), give_up_at)
        if not piece:
            raise asyncio.IncompleteReadError(b"", length)
        counted -= len(piece)
        got += len(piece)
        yield piece


class HoldsBodies(Protocol):
    """What ``BodyRoom`` needs of a connection (``connection.Connection`` keeps it): the bytes
    it holds in all (buffered replies and bodies included) and the frame bodies it holds."""

    body_bytes: int

    def buffered_bytes(self) -> int: ...


class BodyRoom:
    """``read_body``'s ``room`` for one large frame of a connection: counts what arrives into
    the connection's ``body_bytes``, first waiting (a sweep of the watch at a time, until
    ``give_up_at``: then NoRoom) while all connections together would hold more than
    ``budget``. The oldest large frame being read never waits (``frames``: those being read,
    oldest first; ``close`` takes this one out): frames that each hold part of a spent budget
    cannot all wait for each other, and at most one frame's worth goes past the budget, as a
    frame alone that is larger than the budget does."""

    def __init__(self, conn: HoldsBodies, held_by_all: Callable[[], int], budget: int,
                 wait_for_room: Callable[[float], Awaitable[None]], give_up_at: float,
                 frames: list[BodyRoom]) -> None:
        self._conn = conn
        self._held_by_all = held_by_all
        self._budget = budget
        self._wait_for_room = wait_for_room
        self._give_up_at = give_up_at
        self._frames = frames
        frames.append(self)

    def close(self) -> None:
        """The frame is read, refused or cut off."""
        with contextlib.suppress(ValueError):
            self._frames.remove(self)

    async def __call__(self, num_bytes: int) -> None:
        while self._frames[0] is not self:
            held = self._held_by_all()
            if held == self._conn.buffered_bytes() or held + num_bytes <= self._budget:
                break
            left_s = self._give_up_at - time.monotonic()
            if left_s <= 0:
                raise NoRoom(f"no room for {num_bytes} more bytes in the buffer budget")
            await self._wait_for_room(min(1.0, left_s))
        self._conn.body_bytes += num_bytes
