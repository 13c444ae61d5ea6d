"""The pool's start-up helpers on the CPU path: shares cover the range exactly, faulting in from
several threads touches every page and keeps the zeros, and the pool's default chunking splits
it among the start-up threads within the 64 GiB bound."""

from __future__ import annotations

import ctypes
import mmap

import pytest

from kvstore.store.dram.page_lock import PIN_CHUNK_BYTES, fault_in, map_anonymous, shares
from kvstore.store.dram.pool import HostPool, pin_chunk_bytes

GiB = 1 << 30


@pytest.mark.parametrize("size,workers", [(4096, 8), (3 * GiB + 4096, 4), (10 * GiB, 16),
                                          (GiB, 1)])
def test_shares_cover_the_range_in_page_multiples(size: int, workers: int) -> None:
    pieces = shares(size, workers, mmap.PAGESIZE)
    assert pieces[0][0] == 0 and sum(length for _, length in pieces) == size
    for (start, length), (following, _) in zip(pieces, pieces[1:]):
        assert start + length == following and length % mmap.PAGESIZE == 0
    assert len(pieces) <= max(1, min(workers, size // GiB))


def test_fault_in_from_threads_touches_every_page_and_keeps_zeros() -> None:
    size = 64 * mmap.PAGESIZE + 3 * (1 << 20)
    buffer = map_anonymous(size)
    try:
        handle = ctypes.c_char.from_buffer(buffer)
        address = ctypes.addressof(handle)
        del handle
        fault_in(address, size, workers=4)
        view = memoryview(buffer)
        assert bytes(view[::mmap.PAGESIZE]) == bytes(len(view[::mmap.PAGESIZE]))
        view.release()
    finally:
        buffer.close()


def test_default_chunks_split_the_pool_among_threads_within_the_bound() -> None:
    unit = mmap.PAGESIZE
    assert pin_chunk_bytes(512 << 20, 16, unit) == 512 << 20  # small: one chunk
    assert pin_chunk_bytes(64 * GiB, 16, unit) == 4 * GiB
    assert pin_chunk_bytes(2048 * GiB, 16, unit) == PIN_CHUNK_BYTES  # never past 64 GiB
    pool = HostPool(8 << 20, pin=False, workers=4)
    try:
        assert pool.spans() == [(pool.base_address, pool.base_address + pool.capacity_bytes)]
    finally:
        pool.close()
