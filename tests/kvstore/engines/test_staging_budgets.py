"""The copier's staging buffers keep their budgets (CPU, NumPy only): a batch larger than a
device staging slot goes through in parts that move the same bytes, a run or table larger than a
slot is refused before any memory is allocated."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.engines.device_staging import DeviceStaging, staged_parts, staged_sides
from kvstore.engines.run_arrays import RunArrays
from kvstore.engines.table_staging import PinnedTables


def _apply(memory: np.ndarray, runs: RunArrays) -> None:
    """Carry out ``runs`` on one flat byte array (addresses are indices into it)."""
    for src, dst, size in runs.triples():
        memory[dst:dst + size] = memory[src:src + size].copy()


def _shuffled_pieces(rng: np.random.Generator, num_runs: int, gap_bytes: int) -> RunArrays:
    """``num_runs`` pieces of 16..4096 bytes from shuffled places into other shuffled places."""
    sizes = rng.integers(1, 257, num_runs).astype(np.int64) * 16
    slot = int(sizes.max())
    src = rng.permutation(num_runs).astype(np.int64) * slot
    dst = gap_bytes + rng.permutation(num_runs).astype(np.int64) * slot
    return RunArrays(src, dst, sizes)


@pytest.mark.parametrize("max_bytes", [4096, 10_000, 1 << 16, 1 << 30])
def test_staged_parts_cut_a_batch_into_slot_sized_parts_in_order(max_bytes: int) -> None:
    runs = _shuffled_pieces(np.random.default_rng(1), 300, 1 << 22)
    parts = staged_parts(runs, max_bytes)
    assert all(0 < p.total_bytes <= max_bytes for p in parts)
    joined = [t for p in parts for t in p.triples()]
    assert joined == runs.triples()  # every run once, in order, none split
    if max_bytes >= runs.total_bytes:
        assert len(parts) == 1
    else:  # greedy: a part ends only where the next run would not fit
        for p, q in zip(parts, parts[1:]):
            assert p.total_bytes + int(q.num_bytes[0]) > max_bytes


def test_staged_parts_refuse_a_run_larger_than_a_slot() -> None:
    runs = RunArrays(np.array([0, 4096], dtype=np.int64), np.array([1 << 20, 2 << 20],
                                                                   dtype=np.int64),
                     np.array([16, 8192], dtype=np.int64))
    with pytest.raises(ValueError):
        staged_parts(runs, 4096)
    assert staged_parts(RunArrays.of([]), 4096) == []


@pytest.mark.parametrize("to_device", [False, True])
def test_parts_through_staging_move_the_bytes_of_the_whole_batch(to_device: bool) -> None:
    rng = np.random.default_rng(2)
    num_runs, gap = 200, 1 << 21
    runs = _shuffled_pieces(rng, num_runs, gap)
    if to_device:  # the host side is the source
        runs = RunArrays(runs.dst_ptrs, runs.src_ptrs, runs.num_bytes)
    staging0, max_bytes = 2 * gap, 20_000
    memory = rng.integers(0, 256, staging0 + max_bytes, dtype=np.uint8)
    want = memory.copy()
    _apply(want, runs)
    for part in staged_parts(runs, max_bytes):
        bus, device = staged_sides(part, staging0, to_device)
        for step in ((bus, device) if to_device else (device, bus)):
            _apply(memory, step)
    assert np.array_equal(memory[:staging0], want[:staging0])


def test_device_staging_refuses_a_batch_past_its_slot_before_allocating() -> None:
    with pytest.raises(ValueError):
        DeviceStaging().take(1 << 30)  # no GPU here: refused before CuPy is asked for memory
    staging = DeviceStaging(num_slots=2, max_slot_bytes=1 << 20)
    with pytest.raises(ValueError):
        staging.take((1 << 20) + 16)


def test_pinned_tables_refuse_a_table_past_their_slot_before_allocating() -> None:
    assert PinnedTables().take(np.zeros((3, 1 << 20), dtype=np.int64)) is None  # 24 MiB
    tables = PinnedTables(num_slots=2, max_table_bytes=24 * 1000)
    table = np.zeros((3, 1001), dtype=np.int64)
    assert tables.take(table) is None  # the caller uploads it; no pinned slot grows
