"""The piece table (CPU, NumPy only): a chunk's runs equal the per-piece construction it
replaced."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.block_copy import blocks_per_run_for, run_table
from kvstore.engines.run_arrays import CopyRun, PieceTable, RunArrays, coalesce, coalesce_arrays
from kvstore.layout import KVLayout, Region

PIECE = 16 * 8 * 128 * 2  # one layer's K (or V) of one vLLM block: 32 KiB


def _per_piece_runs(layout: KVLayout, ptrs: list[int], block_ids: list[int],
                    host_addrs: list[int], to_device: bool) -> list[CopyRun]:
    """The construction the table replaced: one CopyRun per piece, then ``coalesce``."""
    runs = []
    for block_id, host in zip(block_ids, host_addrs):
        for region, base in zip(layout.regions, ptrs):
            dev = base + region.offset + block_id * region.block_stride
            runs.append(CopyRun(host, dev, region.block_bytes) if to_device
                        else CopyRun(dev, host, region.block_bytes))
            host += region.block_bytes
    return coalesce(runs)


def _vllm_layout(num_layers: int, num_blocks: int) -> tuple[KVLayout, list[int]]:
    """vLLM's flash layout: per layer one tensor [2, num_blocks, ...]: K and V regions."""
    regions, ptrs = [], []
    layer_bytes = 2 * num_blocks * PIECE
    for layer in range(num_layers):
        base = 0x7F00_0000_0000 + layer * (layer_bytes + (1 << 20))
        for kv in range(2):
            regions.append(Region(bytes(64), layer_bytes, kv * num_blocks * PIECE, PIECE, PIECE))
            ptrs.append(base)
    return KVLayout(num_blocks, tuple(regions), device="cuda:0", dtype="bfloat16"), ptrs


def _block_major(num_blocks: int, block_bytes: int) -> tuple[KVLayout, list[int]]:
    layout = KVLayout(num_blocks, (Region(bytes(64), num_blocks * block_bytes, 0, block_bytes,
                                          block_bytes),), device="cuda:0", dtype="bfloat16")
    return layout, [0x7E00_0000_0000]


def _adjacent_regions(num_blocks: int) -> tuple[KVLayout, list[int]]:
    """Two regions whose pieces sit side by side in one block-major arena (they merge)."""
    block = 2 * PIECE
    regions = (Region(bytes(64), num_blocks * block, 0, block, PIECE),
               Region(bytes(64), num_blocks * block, PIECE, block, PIECE))
    base = 0x7D00_0000_0000
    return KVLayout(num_blocks, regions, device="cuda:0", dtype="bfloat16"), [base, base]


LAYOUTS = {"vllm": lambda: _vllm_layout(36, 97),
           "block_major": lambda: _block_major(97, 72 * PIECE),
           "adjacent": lambda: _adjacent_regions(97)}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("to_device", [False, True])
@pytest.mark.parametrize("ids", ["shuffled", "consecutive", "one"])
def test_table_runs_equal_the_per_piece_runs(name: str, to_device: bool, ids: str) -> None:
    layout, ptrs = LAYOUTS[name]()
    rng = np.random.default_rng(7)
    block_ids = {"shuffled": [int(b) for b in rng.permutation(layout.num_blocks)[:41]],
                 "consecutive": list(range(5, 38)), "one": [96]}[ids]
    pool = 0x7C00_0000_0000
    slots = list(range(len(block_ids))) if ids == "consecutive" else \
        [int(s) for s in rng.permutation(200)[:len(block_ids)]]
    host_addrs = [pool + s * layout.block_bytes for s in slots]
    got = PieceTable(layout, ptrs).runs(block_ids, host_addrs, to_device)
    want = _per_piece_runs(layout, ptrs, block_ids, host_addrs, to_device)
    assert got.triples() == [(r.src_ptr, r.dst_ptr, r.num_bytes) for r in want]
    assert got.total_bytes == len(block_ids) * layout.block_bytes
    assert got.src_ptrs.dtype == got.dst_ptrs.dtype == got.num_bytes.dtype == np.int64


def test_vllm_pieces_never_merge_and_block_major_consecutive_blocks_do() -> None:
    layout, ptrs = _vllm_layout(36, 64)
    runs = PieceTable(layout, ptrs).runs(range(8), [i * layout.block_bytes for i in range(8)],
                                         to_device=False)
    assert len(runs) == 8 * 72  # K and V of each layer: 72 pieces of 32 KiB per block
    layout, ptrs = _block_major(64, 72 * PIECE)
    runs = PieceTable(layout, ptrs).runs(range(8), [i * layout.block_bytes for i in range(8)],
                                         to_device=True)
    assert runs.triples() == [(0, ptrs[0], 8 * layout.block_bytes)]


def test_coalesce_arrays_equals_coalesce_on_random_runs() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        runs, src, dst = [], 0, 10_000
        for _ in range(int(rng.integers(0, 40))):
            size = int(rng.choice([0, 16, 32, 48]))
            if rng.random() < 0.3:
                src += 16  # a gap on the source side
            if rng.random() < 0.3:
                dst += 32
            runs.append(CopyRun(src, dst, size))
            src, dst = src + size, dst + size
        got = coalesce_arrays(RunArrays.of(runs))
        assert got.triples() == [(r.src_ptr, r.dst_ptr, r.num_bytes) for r in coalesce(runs)]
        assert got.coalesced and coalesce_arrays(got) is got  # merged once, not again


def test_table_refuses_mismatched_host_addresses_and_region_pointers() -> None:
    layout, ptrs = _vllm_layout(2, 8)
    with pytest.raises(ValueError):
        PieceTable(layout, ptrs[:-1])
    with pytest.raises(ValueError):
        PieceTable(layout, ptrs).runs([1, 2], [0], to_device=True)


def test_run_table_checks_alignment_and_lengths_without_a_gpu() -> None:
    table = run_table(np.array([0, 16]), [32, 48], np.array([16, 4096]))
    assert table.dtype == np.int64 and table.tolist() == [[0, 16], [32, 48], [16, 4096]]
    for bad in (([8], [16], [32]), ([0], [16], [24]), ([0], [16], [0]), ([0, 16], [0], [16])):
        with pytest.raises(ValueError):
            run_table(*bad)
    assert blocks_per_run_for(PIECE, unroll=8) == 1
    assert blocks_per_run_for(72 * PIECE, unroll=8) == 72
    assert blocks_per_run_for(1 << 40) == 128


def _apply(memory: np.ndarray, runs: RunArrays) -> None:
    """Carry out ``runs`` on one flat byte array (addresses are indices into it)."""
    for src, dst, size in runs.triples():
        memory[dst:dst + size] = memory[src:src + size].copy()


def _flat_table(name: str, num_blocks: int) -> tuple[KVLayout, PieceTable, int]:
    """(layout, piece table, device bytes) of a layout placed at the start of one flat byte
    array (addresses are indices into it): vLLM's with 3 layers, or a block-major arena."""
    if name == "vllm":
        layout, _ = _vllm_layout(3, num_blocks)
        layer_bytes = 2 * num_blocks * PIECE
        ptrs = [layer * layer_bytes for layer in range(3) for _ in range(2)]
        return layout, PieceTable(layout, ptrs), 3 * layer_bytes
    layout, _ = _block_major(num_blocks, 4 * PIECE)
    return layout, PieceTable(layout, [0]), num_blocks * layout.block_bytes


@pytest.mark.parametrize("name", ["vllm", "block_major"])
def test_staged_sides_move_the_same_bytes_as_the_direct_runs(name: str) -> None:
    from kvstore.engines.device_staging import staged_sides

    layout, table, device_bytes = _flat_table(name, num_blocks=9)
    ids, slots = [7, 2, 5, 0], [3, 0, 1, 6]
    host0 = device_bytes  # host pool after the device bytes, staging after the pool
    staging0 = host0 + 8 * layout.block_bytes
    memory = np.random.default_rng(4).integers(0, 256, staging0 + 4 * layout.block_bytes,
                                               dtype=np.uint8)
    addrs = [host0 + s * layout.block_bytes for s in slots]
    want = memory.copy()
    _apply(want, table.runs(ids, addrs, to_device=False))  # the direct save

    save = table.runs(ids, addrs, to_device=False)
    bus, device = staged_sides(save, staging0, to_device=False)
    assert len(bus) <= len(ids)  # a run per block (or fewer) crosses the bus
    _apply(memory, device)  # gather on the GPU
    _apply(memory, bus)  # then across the bus
    assert np.array_equal(memory[:staging0], want[:staging0])

    targets = [1, 8, 3, 4]
    want = memory.copy()
    _apply(want, table.runs(targets, addrs, to_device=True))  # the direct load
    bus, device = staged_sides(table.runs(targets, addrs, to_device=True), staging0,
                               to_device=True)
    assert len(bus) <= len(ids)
    _apply(memory, bus)
    _apply(memory, device)
    assert np.array_equal(memory[:staging0], want[:staging0])


@pytest.mark.parametrize("name", ["vllm", "block_major"])
def test_packed_pieces_move_the_same_bytes_as_the_direct_runs(name: str) -> None:
    """``copy_pieces``'s reference, over the piece table's region table, packs a block into
    the store's host layout (the direct runs' bytes) and unpacks it into other blocks."""
    from kernels.block_copy import copy_pieces_reference, region_table

    layout, table, device_bytes = _flat_table(name, num_blocks=9)
    regions = region_table(table.device_base, table.device_stride, table.piece_bytes,
                           table.host_offset)
    ids = [7, 2, 5, 0]
    host0 = device_bytes
    memory = np.random.default_rng(6).integers(0, 256, host0 + len(ids) * layout.block_bytes,
                                               dtype=np.uint8)
    addrs = [host0 + i * layout.block_bytes for i in range(len(ids))]
    want = memory.copy()
    _apply(want, table.runs(ids, addrs, to_device=False))
    copy_pieces_reference(memory, regions, ids, host0, layout.block_bytes, pack=True)
    assert np.array_equal(memory, want)

    targets = [1, 8, 3, 4]
    _apply(want, table.runs(targets, addrs, to_device=True))
    copy_pieces_reference(memory, regions, targets, host0, layout.block_bytes, pack=False)
    assert np.array_equal(memory, want)


def test_packed_slots_name_where_each_block_goes() -> None:
    """With ``slots``, block ``j`` is packed at slot ``slots[j]`` (and unpacked from it): the
    same bytes as packing in order into a buffer and moving each block to its slot."""
    from kernels.block_copy import copy_pieces_reference, region_table

    layout, table, device_bytes = _flat_table("vllm", num_blocks=9)
    regions = region_table(table.device_base, table.device_stride, table.piece_bytes,
                           table.host_offset)
    ids, slots, bb = [7, 2, 5], [4, 0, 2], layout.block_bytes
    memory = np.random.default_rng(8).integers(0, 256, device_bytes + 5 * bb, dtype=np.uint8)
    in_order = memory.copy()
    copy_pieces_reference(in_order, regions, ids, device_bytes, bb, pack=True)
    copy_pieces_reference(memory, regions, ids, device_bytes, bb, pack=True, slots=slots)
    for j, slot in enumerate(slots):
        got = memory[device_bytes + slot * bb:device_bytes + (slot + 1) * bb]
        assert np.array_equal(got, in_order[device_bytes + j * bb:device_bytes + (j + 1) * bb])

    targets = [1, 8, 3]
    want = memory.copy()
    for j, slot in enumerate(slots):  # unpacking slot s into block t = the in-order unpack
        want[device_bytes + j * bb:device_bytes + (j + 1) * bb] = \
            memory[device_bytes + slot * bb:device_bytes + (slot + 1) * bb]
    copy_pieces_reference(want, regions, targets, device_bytes, bb, pack=False)
    copy_pieces_reference(memory, regions, targets, device_bytes, bb, pack=False, slots=slots)
    engine = slice(0, device_bytes)
    assert np.array_equal(memory[engine], want[engine])


def test_region_table_refuses_unaligned_or_empty_pieces() -> None:
    from kernels.block_copy import region_table

    good = region_table([0, 4096], [64, 64], [32, 16], [0, 32])
    assert good.shape == (4, 2) and good.dtype == np.int64
    for bad in (([8], [64], [32], [0]), ([0], [64], [0], [0]), ([0], [64], [24], [0]),
                ([0], [64], [32], [8]), ([], [], [], [])):
        with pytest.raises(ValueError):
            region_table(*bad)
