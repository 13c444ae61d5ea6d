"""The host pool and its offset allocator: tiling, coalescing, alignment, no overlap."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.allocator import OffsetAllocator
from kvstore.store.dram.pool import HostPool, PinError


def test_allocations_are_aligned_views_of_one_buffer():
    pool = HostPool(1 << 20, alignment=4096, pin=False)
    try:
        a = pool.allocate(100)
        b = pool.allocate(5000)
        assert a.offset % 4096 == 0 and b.offset % 4096 == 0
        assert a.reserved_bytes == 4096 and b.reserved_bytes == 8192
        assert pool.address(b) == pool.base_address + b.offset
        assert pool.base_address % 4096 == 0
        pool.view(a)[:] = b"a" * 100
        pool.view(b)[:] = b"b" * 5000
        assert bytes(pool.view(a)) == b"a" * 100 and len(pool.view(b, padded=True)) == 8192
        assert pool.used_bytes == 12288 and not pool.pinned
        pool.check_integrity()
        pool.free(a)
        with pytest.raises(ValueError):
            pool.free(a)  # double free
        pool.free(b)
        assert pool.used_bytes == 0
        pool.check_integrity()
    finally:
        pool.close()


def test_full_pool_returns_none_and_coalesces_back():
    alloc = OffsetAllocator(64 * 4096, alignment=4096)
    parts = [alloc.allocate(4096) for _ in range(64)]
    assert all(p is not None for p in parts)
    assert alloc.allocate(1) is None and alloc.free_bytes == 0
    random.Random(3).shuffle(parts)
    for p in parts:
        alloc.free(p)
        alloc.check_integrity()
    assert alloc.largest_free_bytes == 64 * 4096  # one extent again
    assert alloc.allocate(64 * 4096) is not None


def test_zero_byte_allocations_still_hold_space():
    alloc = OffsetAllocator(8192, alignment=4096)
    a, b = alloc.allocate(0), alloc.allocate(0)
    assert a.offset != b.offset and a.num_bytes == 0 and a.reserved_bytes == 4096


def test_allocate_at_takes_exactly_a_free_range():
    alloc = OffsetAllocator(10 * 4096, alignment=4096)
    mid = alloc.allocate_at(4 * 4096, 8192)
    assert mid.offset == 4 * 4096 and mid.reserved_bytes == 8192
    assert alloc.allocate_at(5 * 4096, 1) is None  # inside the taken range
    assert alloc.allocate_at(9 * 4096, 8192) is None  # past the end
    alloc.check_integrity()
    assert alloc.largest_free_bytes == 4 * 4096


def test_best_fit_prefers_the_smallest_hole():
    alloc = OffsetAllocator(16 * 4096, alignment=4096)
    blocks = [alloc.allocate(4096) for _ in range(16)]
    alloc.free(blocks[2])  # a 1-unit hole
    alloc.free(blocks[6])
    alloc.free(blocks[7])  # a 2-unit hole
    assert alloc.allocate(4096).offset == blocks[2].offset
    assert alloc.allocate(8192).offset == blocks[6].offset


def test_pin_true_without_a_gpu_raises():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is present: pinning succeeds here")
    except Exception:
        pass
    with pytest.raises(PinError):
        HostPool(1 << 20, pin=True)
    pool = HostPool(1 << 20)  # auto falls back to plain memory
    assert not pool.pinned
    pool.close()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40_000), st.integers(0, 10**6)),
                max_size=80),
       st.sampled_from([256, 4096]))
def test_random_alloc_free_sequences_keep_the_pool_whole(ops, alignment):
    pool = HostPool(256 * 1024, alignment=alignment, pin=False, populate=False)
    live: dict[int, tuple[object, bytes]] = {}
    try:
        for n, (is_alloc, size, pick) in enumerate(ops):
            if is_alloc or not live:
                a = pool.allocate(size)
                if a is None:
                    assert pool.largest_free_bytes < pool.reserved_size(size)
                    continue
                assert a.offset % alignment == 0 and a.num_bytes == size
                pattern = bytes([n % 251 + 1]) * size
                pool.view(a)[:] = pattern
                live[a.offset] = (a, pattern)
            else:
                offset = sorted(live)[pick % len(live)]
                a, pattern = live.pop(offset)
                assert bytes(pool.view(a)) == pattern  # no one else wrote into it
                pool.free(a)
            pool.check_integrity()
        assert pool.used_bytes == sum(a.reserved_bytes for a, _ in live.values())
        for a, pattern in live.values():
            assert bytes(pool.view(a)) == pattern
    finally:
        pool.close()


def test_no_allocation_crosses_or_touches_a_chunk_boundary():
    """A copy whose host range spans two pinned chunks fails on a GPU, and the copier merges
    runs that continue each other: a fence before every inner boundary keeps allocations
    inside one chunk and apart across boundaries. The fences are not counted as used."""
    chunk = 16 * 4096
    pool = HostPool(5 * chunk + 3 * 4096, alignment=4096, pin=False, chunk_bytes=chunk)
    try:
        assert pool.used_bytes == 0 and pool.num_allocations == 0 and pool.allocations() == []
        assert pool.fence_bytes == 5 * 4096
        spans = pool.spans()
        assert [e - s for s, e in spans] == [chunk] * 5 + [3 * 4096]
        rng = random.Random(3)
        allocs = []
        while (a := pool.allocate(rng.choice([1, 4096, 5000, 3 * 4096]))) is not None:
            allocs.append(a)
        pool.check_integrity()
        assert pool.used_bytes + pool.fence_bytes + pool.free_bytes == pool.capacity_bytes
        for a in allocs:
            assert a.offset // chunk == (a.end - 1) // chunk, f"{a} crosses a boundary"
            assert a.end % chunk or a.end == pool.capacity_bytes, f"{a} ends at a boundary"
        assert {a.offset // chunk for a in allocs} == set(range(6))
        assert pool.num_allocations == len(allocs) and len(pool.allocations()) == len(allocs)
        for a in allocs:
            pool.free(a)
        assert pool.used_bytes == 0 and pool.largest_free_bytes < chunk
        pool.check_integrity()
    finally:
        pool.close()


def test_chunk_size_is_checked():
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostPool(1 << 20, alignment=4096, pin=False, chunk_bytes=4096)
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostPool(1 << 20, alignment=4096, pin=False, chunk_bytes=3 * 4096 + 1)
