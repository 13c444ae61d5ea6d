"""GPU: a chunk's runs from the piece table move blocks byte-exactly, by every copy method.

In-process (no daemon): the table over real device buffers in vLLM's flash layout (one tensor
per layer, K and V regions of 32 KiB pieces) and in kvengine's block-major layout, shuffled odd
block ids to shuffled pinned slots and back into other blocks, through ``CudaCopier`` with the
kernel alone, through device staging, by ``cuMemcpyBatchAsync`` and by a memcpy per run (each
method chosen by the copier's ``CopySettings``). Twice in a row, so the staging and table rings
are reused.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.engines.copier import CudaCopier
from kvstore.engines.copy_settings import CopySettings
from kvstore.engines.run_arrays import PieceTable
from kvstore.layout import KVLayout, Region

pytestmark = pytest.mark.gpu

PIECE = 16 * 8 * 128 * 2
NUM_BLOCKS = 37


def _buffers(cp, name: str):
    """(layout, device buffers, region pointers, piece views of block b as a host array)."""
    rng = cp.random.RandomState(5)
    if name == "vllm":
        num_layers = 5
        layers = [rng.randint(0, 256, 2 * NUM_BLOCKS * PIECE, dtype=cp.uint8)
                  for _ in range(num_layers)]
        regions = tuple(Region(bytes(64), 2 * NUM_BLOCKS * PIECE, kv * NUM_BLOCKS * PIECE, PIECE,
                               PIECE) for _ in layers for kv in range(2))
        ptrs = [t.data.ptr for t in layers for _ in range(2)]

        def block(b: int) -> np.ndarray:
            return np.concatenate([cp.asnumpy(t[kv * NUM_BLOCKS * PIECE + b * PIECE:][:PIECE])
                                   for t in layers for kv in range(2)])
        buffers = layers
    else:
        block_bytes = 6 * PIECE
        arena = rng.randint(0, 256, NUM_BLOCKS * block_bytes, dtype=cp.uint8)
        size = NUM_BLOCKS * block_bytes
        if name == "split":  # K and V halves of each block-major block as two regions
            half = block_bytes // 2
            regions = (Region(bytes(64), size, 0, block_bytes, half),
                       Region(bytes(64), size, half, block_bytes, half))
        else:
            regions = (Region(bytes(64), size, 0, block_bytes, block_bytes),)
        ptrs = [arena.data.ptr] * len(regions)

        def block(b: int) -> np.ndarray:
            return cp.asnumpy(arena[b * block_bytes:(b + 1) * block_bytes])
        buffers = [arena]
    layout = KVLayout(NUM_BLOCKS, regions, device="cuda:0", dtype="uint8")
    return layout, buffers, ptrs, block


@pytest.mark.parametrize("name", ["vllm", "block_major"])
@pytest.mark.parametrize("method", ["staged", "kernel", "batch", "memcpy"])
def test_table_runs_round_trip_byte_exact(name: str, method: str) -> None:
    import cupy as cp

    from kvstore.engines import cuda_batch

    if method == "batch" and not cuda_batch.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync")
    layout, buffers, ptrs, block = _buffers(cp, name)
    table = PieceTable(layout, ptrs)
    rng = np.random.default_rng(11)
    ids = [int(b) for b in rng.permutation(NUM_BLOCKS)[:23]]  # shuffled, odd count
    num_slots = 41
    pinned = cp.cuda.alloc_pinned_memory(num_slots * layout.block_bytes)
    host = np.frombuffer(pinned, dtype=np.uint8, count=num_slots * layout.block_bytes)
    host[:] = 0
    slots = [int(s) for s in rng.permutation(num_slots)[:len(ids)]]
    addrs = [host.ctypes.data + s * layout.block_bytes for s in slots]
    # save_kernels: the save direction takes the kernel methods too (off by default)
    copier = CudaCopier(0, CopySettings(small_runs=method, large_runs=method, save_kernels=True))
    expect = {b: block(b) for b in range(NUM_BLOCKS)}

    rows = host.reshape(num_slots, layout.block_bytes)
    for _ in range(2):
        host[:] = 0
        # two submissions in flight at once: halves of the batch, waited for together
        half = len(ids) // 2
        handles = [copier.device_to_host(table.runs(ids[:half], addrs[:half], to_device=False)),
                   copier.device_to_host(table.runs(ids[half:], addrs[half:], to_device=False))]
        for handle in handles:
            handle.wait()
        for b, s in zip(ids, slots):
            assert np.array_equal(rows[s], expect[b]), f"save of block {b} into slot {s}"

    targets = [int(b) for b in rng.permutation(NUM_BLOCKS)[:len(ids)]]
    for t in buffers:
        t.fill(0)
    copier.host_to_device(table.runs(targets, addrs, to_device=True)).wait()
    for b, t in zip(ids, targets):
        assert np.array_equal(block(t), expect[b]), f"load of block {b} into block {t}"
    untouched = set(range(NUM_BLOCKS)) - set(targets)
    assert all(not block(b).any() for b in untouched)  # nothing else was written


def test_kernel_takes_numpy_tables_past_the_old_65535_run_cap() -> None:
    import cupy as cp

    from kernels.block_copy import copy_runs_varlen

    num_runs = 70_000
    src = cp.arange(num_runs * 4, dtype=cp.int32)
    dst = cp.zeros_like(src)
    order = np.random.default_rng(2).permutation(num_runs).astype(np.int64)
    src_ptrs = src.data.ptr + order * 16
    dst_ptrs = dst.data.ptr + np.arange(num_runs, dtype=np.int64) * 16
    copy_runs_varlen(src_ptrs, dst_ptrs, np.full(num_runs, 16, dtype=np.int64))
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.array_equal(dst.reshape(-1, 4), src.reshape(-1, 4)[cp.asarray(order)]))


def test_a_staged_batch_past_a_staging_slot_goes_in_parts_byte_exact() -> None:
    """One submission of ~94 MB of vLLM pieces: three 32 MiB staging parts, in order, each
    through its own ring slot; saved and loaded back byte for byte."""
    import cupy as cp

    # the default for loads, named (this test is about it), and for saves here too
    settings = CopySettings(small_runs="staged", save_kernels=True)
    num_layers, num_blocks = 36, 48
    rng = cp.random.RandomState(9)
    layers = [rng.randint(0, 256, 2 * num_blocks * PIECE, dtype=cp.uint8)
              for _ in range(num_layers)]
    regions = tuple(Region(bytes(64), 2 * num_blocks * PIECE, kv * num_blocks * PIECE, PIECE,
                           PIECE) for _ in layers for kv in range(2))
    layout = KVLayout(num_blocks, regions, device="cuda:0", dtype="uint8")
    table = PieceTable(layout, [t.data.ptr for t in layers for _ in range(2)])
    ids = [int(b) for b in np.random.default_rng(3).permutation(num_blocks)[:40]]
    assert len(ids) * layout.block_bytes > 2 * settings.staging_slot_bytes
    pinned = cp.cuda.alloc_pinned_memory(len(ids) * layout.block_bytes)
    host = np.frombuffer(pinned, dtype=np.uint8, count=len(ids) * layout.block_bytes)
    addrs = [host.ctypes.data + i * layout.block_bytes for i in range(len(ids))]
    before = [cp.asnumpy(t) for t in layers]
    copier = CudaCopier(0, settings)
    copier.device_to_host(table.runs(ids, addrs, to_device=False)).wait()
    for t in layers:
        t.fill(0)
    copier.host_to_device(table.runs(ids, addrs, to_device=True)).wait()
    for t, want in zip(layers, before):
        got = cp.asnumpy(t).reshape(2, num_blocks, PIECE)
        want = want.reshape(2, num_blocks, PIECE)
        assert np.array_equal(got[:, ids], want[:, ids])
        untouched = sorted(set(range(num_blocks)) - set(ids))
        assert not got[:, untouched].any()


@pytest.mark.parametrize("name", ["vllm", "block_major", "split"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_packed_blocks_round_trip_byte_exact(name: str, contiguous: bool) -> None:
    """``blocks_to_host`` / ``blocks_to_device`` (``copy_pieces`` through staging), shuffled
    block ids to consecutive or shuffled pinned slots, in parts past a staging slot (slots cut
    small here), twice in a row; nothing outside the named blocks is written."""
    import cupy as cp

    layout, buffers, ptrs, block = _buffers(cp, name)
    table = PieceTable(layout, ptrs)
    rng = np.random.default_rng(12)
    ids = [int(b) for b in rng.permutation(NUM_BLOCKS)[:23]]
    num_slots = 41
    pinned = cp.cuda.alloc_pinned_memory(num_slots * layout.block_bytes)
    host = np.frombuffer(pinned, dtype=np.uint8, count=num_slots * layout.block_bytes)
    slots = list(range(len(ids))) if contiguous else \
        [int(s) for s in rng.permutation(num_slots)[:len(ids)]]
    addrs = [host.ctypes.data + s * layout.block_bytes for s in slots]
    # every layout packed; slots of 5 blocks: 23 blocks go in five parts
    copier = CudaCopier(0, CopySettings(packed_min_pieces=1, save_kernels=True,
                                        staging_slot_bytes=5 * layout.block_bytes))
    expect = {b: block(b) for b in range(NUM_BLOCKS)}
    rows = host.reshape(num_slots, layout.block_bytes)
    for _ in range(2):
        host[:] = 0
        half = len(ids) // 2
        handles = [copier.blocks_to_host(table, ids[:half], addrs[:half]),
                   copier.blocks_to_host(table, ids[half:], addrs[half:])]
        for handle in handles:
            handle.wait()
        for b, s in zip(ids, slots):
            assert np.array_equal(rows[s], expect[b]), f"save of block {b} into slot {s}"
    assert table in copier.regions and copier.regions.get(table) is not None  # went packed

    targets = [int(b) for b in rng.permutation(NUM_BLOCKS)[:len(ids)]]
    for t in buffers:
        t.fill(0)
    cp.cuda.Device().synchronize()  # the fills ran on CuPy's stream, not the copier's
    copier.blocks_to_device(table, targets, addrs).wait()
    for b, t in zip(ids, targets):
        assert np.array_equal(block(t), expect[b]), f"load of block {b} into block {t}"
    untouched = set(range(NUM_BLOCKS)) - set(targets)
    assert all(not block(b).any() for b in untouched)
    assert copier.counts["batches_packed"] == 5 and not copier.counts["batches_not_packed_host"]


def test_by_default_a_save_runs_no_kernel_and_a_load_goes_packed() -> None:
    """The shipped settings on vLLM's layout (10 pieces a block): the save is one driver batch
    on the copy engines (no pack or staging kernel beside an engine's step), the load is packed;
    both byte-exact."""
    import cupy as cp

    layout, buffers, ptrs, block = _buffers(cp, "vllm")
    table = PieceTable(layout, ptrs)
    ids = [int(b) for b in np.random.default_rng(21).permutation(NUM_BLOCKS)[:9]]
    pinned = cp.cuda.alloc_pinned_memory(len(ids) * layout.block_bytes)
    host = np.frombuffer(pinned, dtype=np.uint8, count=len(ids) * layout.block_bytes)
    addrs = [host.ctypes.data + i * layout.block_bytes for i in range(len(ids))]
    expect = {b: block(b) for b in ids}
    copier = CudaCopier(0, CopySettings())
    copier.blocks_to_host(table, ids, addrs).wait()
    rows = host.reshape(len(ids), layout.block_bytes)
    assert all(np.array_equal(rows[i], expect[b]) for i, b in enumerate(ids))
    saves = {way: n for way, n in copier.counts.items()  # by method
             if way.startswith("save_") and way not in ("save_blocks", "save_runs")}
    assert saves in ({"save_batch": 1}, {"save_memcpy": 1}), saves  # memcpy: no batch API
    assert copier.counts["batches_packed"] == 0
    for t in buffers:
        t.fill(0)
    cp.cuda.Device().synchronize()
    copier.blocks_to_device(table, ids, addrs).wait()
    assert all(np.array_equal(block(b), expect[b]) for b in ids)
    assert copier.counts["batches_packed"] == 1


def test_a_new_table_on_a_warm_copier_reads_its_own_regions() -> None:
    """A second registration's piece table (new buffers) on a copier whose rings are warm:
    its region table is on the device before the first launch reads it, so blocks come from
    the new buffers, never the old ones."""
    import cupy as cp

    copier = CudaCopier(0, CopySettings(packed_min_pieces=1, save_kernels=True))
    num_slots = 8
    kept = []  # earlier rounds' buffers stay allocated: a stale table would read them
    for round_ in range(3):
        layout, buffers, ptrs, block = _buffers(cp, "vllm")
        kept.append(buffers)
        for t in buffers:
            t += round_ + 1  # each round's bytes differ from the last
        cp.cuda.Device().synchronize()
        table = PieceTable(layout, ptrs)
        pinned = cp.cuda.alloc_pinned_memory(num_slots * layout.block_bytes)
        host = np.frombuffer(pinned, dtype=np.uint8, count=num_slots * layout.block_bytes)
        host[:] = 0
        ids = [5, 2, 7, 0]
        addrs = [host.ctypes.data + i * layout.block_bytes for i in range(len(ids))]
        copier.blocks_to_host(table, ids, addrs).wait()
        rows = host.reshape(num_slots, layout.block_bytes)
        for i, b in enumerate(ids):
            assert np.array_equal(rows[i], block(b)), f"round {round_}, block {b}"
        del table  # its region table may go; the next round's is a new upload


def test_packed_blocks_to_pageable_memory_fall_back_to_runs() -> None:
    """Host memory the GPU cannot address (plain NumPy) never goes packed: the runs path
    (a memcpy each) moves it, byte for byte."""
    import cupy as cp

    layout, buffers, ptrs, block = _buffers(cp, "vllm")
    table = PieceTable(layout, ptrs)
    ids = [3, 1, 4]
    host = np.zeros(len(ids) * layout.block_bytes, dtype=np.uint8)
    addrs = [host.ctypes.data + i * layout.block_bytes for i in range(len(ids))]
    copier = CudaCopier(0, CopySettings(save_kernels=True))  # a save may pack: host refuses
    copier.blocks_to_host(table, ids, addrs).wait()
    rows = host.reshape(len(ids), layout.block_bytes)
    for i, b in enumerate(ids):
        assert np.array_equal(rows[i], block(b))
    assert table not in copier.regions  # never considered for packing
    assert copier.counts["batches_not_packed_host"] == 1 and not copier.counts["batches_packed"]


def test_copy_pieces_matches_its_numpy_reference() -> None:
    """The kernel against ``copy_pieces_reference`` on one flat buffer: odd piece sizes (all
    multiples of 16), strides and offsets, pack then unpack into other blocks, in order and
    into or out of named packed slots, with a whole grid and with a few CTAs looping."""
    import cupy as cp

    from kernels.block_copy import copy_pieces_reference, launch_pieces, region_table

    sizes = np.array([48, 4096, 16, 1040], dtype=np.int64)
    num_blocks = 9
    strides = sizes * 3
    base = np.concatenate(([0], np.cumsum(strides * num_blocks)[:-1])).astype(np.int64)
    packed_at = int(base[-1] + strides[-1] * num_blocks)
    block_bytes = int(sizes.sum())
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    total = packed_at + 5 * block_bytes
    start = np.random.default_rng(4).integers(0, 256, total, dtype=np.uint8)
    dev = cp.asarray(start)
    table = region_table(base + dev.data.ptr, strides, sizes, offsets)
    regions = cp.asarray(table)
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    for ids, pack, slots, ctas in (([7, 2, 5, 0, 8], True, None, None),
                                   ([1, 3, 6, 4, 2], False, None, None),
                                   ([4, 1, 8], True, [3, 0, 4], None),
                                   ([0, 6, 2], False, [4, 2, 1], None),
                                   ([5, 3, 7, 1], True, [1, 4, 0, 2], 2),  # CTAs loop
                                   ([2, 8, 0, 6], False, [2, 0, 4, 1], 3)):
        want = cp.asnumpy(dev)
        copy_pieces_reference(want, region_table(base, strides, sizes, offsets), ids, packed_at,
                              block_bytes, pack, slots)
        ids_dev = cp.asarray(np.array(ids, dtype=np.int64))
        slots_dev = None if slots is None else cp.asarray(np.array(slots, dtype=np.int64))
        cp.cuda.Device().synchronize()  # uploaded on CuPy's stream, launched on another
        launch_pieces(regions.data.ptr, len(sizes), ids_dev.data.ptr, len(ids),
                      dev.data.ptr + packed_at, block_bytes, int(sizes.max()), pack, stream,
                      slots_ptr=0 if slots_dev is None else slots_dev.data.ptr, max_ctas=ctas)
        stream.synchronize()
        assert np.array_equal(cp.asnumpy(dev), want), f"pack={pack} slots={slots} ctas={ctas}"


def test_adjacent_blocks_on_both_sides_cross_the_bus_as_one_copy() -> None:
    """kvengine's block-major layout (one piece a block) by the shipped settings: a load of
    consecutive block ids from consecutive slots is one copy, counted (``load_blocks``,
    ``load_runs``); shuffled ones stay a copy each; both byte-exact."""
    import cupy as cp

    layout, buffers, ptrs, block = _buffers(cp, "block_major")
    table = PieceTable(layout, ptrs)
    pinned = cp.cuda.alloc_pinned_memory(16 * layout.block_bytes)
    host = np.frombuffer(pinned, dtype=np.uint8, count=16 * layout.block_bytes)
    addrs = [host.ctypes.data + i * layout.block_bytes for i in range(16)]
    expect = {b: block(b) for b in range(NUM_BLOCKS)}
    copier = CudaCopier(0, CopySettings())
    copier.blocks_to_host(table, list(range(3, 11)), addrs[:8]).wait()  # slots 0-7: blocks 3-10
    assert (copier.counts["save_blocks"], copier.counts["save_runs"]) == (8, 1)
    rows = host.reshape(16, layout.block_bytes)
    assert all(np.array_equal(rows[i], expect[3 + i]) for i in range(8))
    for t in buffers:
        t.fill(0)
    cp.cuda.Device().synchronize()
    copier.blocks_to_device(table, list(range(20, 28)), addrs[:8]).wait()
    assert (copier.counts["load_blocks"], copier.counts["load_runs"]) == (8, 1)
    shuffled = [int(b) for b in np.random.default_rng(4).permutation(8)]
    copier.blocks_to_device(table, [36 - b for b in shuffled], [addrs[b] for b in shuffled]).wait()
    assert (copier.counts["load_blocks"], copier.counts["load_runs"]) == (16, 9)
    assert all(np.array_equal(block(20 + i), expect[3 + i]) for i in range(8))
    assert all(np.array_equal(block(36 - i), expect[3 + i]) for i in range(8))
