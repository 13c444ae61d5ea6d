"""Copy bounds: host ranges inside one pinned span, block ids inside the arena."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.engines.copy_bounds import CopyOutOfBounds, HostSpans, check_block_ids
from kvstore.store.dram.pool import HostPool


def test_host_ranges_must_lie_inside_one_span():
    spans = HostSpans([(2000, 3000), (1000, 2000)])  # unsorted, touching
    spans.check([1000, 1500, 2000, 2900], 100)
    spans.check([], 100)
    spans.check([1000, 2000] * 40, 100)  # past a chunk's few: the vectorised check
    for bad in ([1950], [999], [2950], [3000], [0]):
        with pytest.raises(CopyOutOfBounds, match="outside|across"):
            spans.check(bad, 100)
        with pytest.raises(CopyOutOfBounds, match=f"{bad[0]:#x}"):
            spans.check([1000] * 40 + bad + [2000], 100)


def test_every_pool_allocation_passes_its_own_spans():
    pool = HostPool(8 * 65536, alignment=4096, pin=False, chunk_bytes=65536)
    try:
        spans = HostSpans(pool.spans())
        addrs = []
        while (a := pool.allocate(3 * 4096)) is not None:
            addrs.append(pool.address(a))
        spans.check(np.array(addrs), 3 * 4096)
        with pytest.raises(CopyOutOfBounds):  # one unit too long reaches past a chunk's fence
            spans.check(np.array(addrs), 5 * 4096)
    finally:
        pool.close()


def test_block_ids_inside_the_arena():
    check_block_ids(np.array([0, 5, 9]), 10)
    check_block_ids(np.array([], dtype=np.int64), 10)
    for bad in ([10], [-1], [3, 11]):
        with pytest.raises(CopyOutOfBounds, match="outside the arena"):
            check_block_ids(np.array(bad), 10)
