"""A frame body is read whole and byte-exact, small ones as bytes and large ones piece by piece
into a private mapping; a peer that goes away mid-body is an IncompleteReadError either way."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvstore.daemon.frame_body import PIECE_BYTES, read_body


def _read(data: bytes, length: int, small_max: int, eof: bool = True):
    async def run():
        reader = asyncio.StreamReader(limit=2**16)

        async def feed() -> None:  # in small pieces, as a socket delivers them
            for start in range(0, len(data), 48 * 1024):
                reader.feed_data(data[start:start + 48 * 1024])
                await asyncio.sleep(0)
            if eof:
                reader.feed_eof()

        feeder = asyncio.create_task(feed())
        try:
            return await read_body(reader, length, small_max)
        finally:
            await feeder
    return asyncio.run(run())


def test_a_small_body_is_bytes_and_a_large_one_a_mapping_with_the_same_bytes() -> None:
    data = os.urandom(3 * PIECE_BYTES + 12345)
    small = _read(data[:1000], 1000, small_max=4096)
    assert isinstance(small, bytes) and small == data[:1000]
    large = _read(data + b"next frame", len(data), small_max=4096, eof=False)
    assert isinstance(large, memoryview) and len(large) == len(data)
    assert large.tobytes() == data


@pytest.mark.parametrize("small_max", [0, 1 << 30])
def test_a_body_cut_short_is_an_incomplete_read(small_max: int) -> None:
    with pytest.raises(asyncio.IncompleteReadError):
        _read(os.urandom(5000), 8000, small_max)


@pytest.mark.parametrize("small_max", [0, 1 << 30])
def test_room_counts_the_whole_body_never_more_than_a_piece_ahead(small_max: int) -> None:
    """What ``room`` is asked for adds up to the body, each piece asked for before it is read:
    what a header announces and never sends is never counted."""
    data = os.urandom(2 * PIECE_BYTES + 777)
    counted: list[int] = []

    async def run():
        reader = asyncio.StreamReader(limit=2**16)
        reader.feed_data(data[:PIECE_BYTES // 2])

        async def room(num_bytes: int) -> None:
            counted.append(num_bytes)

        task = asyncio.create_task(read_body(reader, len(data), small_max, room))
        await asyncio.sleep(0.01)  # half a piece arrived, the rest has not
        # what arrived and the piece being read, not the announced length
        assert sum(counted) <= PIECE_BYTES // 2 + PIECE_BYTES
        reader.feed_data(data[PIECE_BYTES // 2:])
        return await task

    body = asyncio.run(run())
    assert bytes(body) == data and sum(counted) == len(data)
