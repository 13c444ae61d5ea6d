"""Launchers for ``copy_runs`` and ``copy_pieces`` (block_copy.cu) and their NumPy references.

A batch of runs is an int64 table ``[3, num_runs]`` (sources, destinations, sizes) built from
NumPy arrays without a Python loop (``run_table``); ``launch_table`` runs the kernel on a table
the device can read (a device array, or mapped pinned memory the caller keeps alive until the
launch completed), ``copy_runs_varlen`` uploads the table itself with one host-to-device copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

THREADS = 256
# 16-byte loads in flight per thread: the best of 4, 8 and 16 measured (kernels/KERNELS.md).
# The default of ``CopySettings.kernel_unroll``; a launch takes the value it is given.
UNROLL = 4
UNROLLS = (4, 8, 16)  # the values compared
_MAX_BLOCKS_PER_RUN = 128
# The most CTAs of a device-to-device copy_runs launch: a few waves on an H200 (132 SMs, 8
# resident CTAs of 256 threads each).
DEVICE_GRID_CTAS = 2048
_MAX_GRID = (1 << 31) - 1


def run_table(src_ptrs: Sequence[int] | np.ndarray, dst_ptrs: Sequence[int] | np.ndarray,
              num_bytes: Sequence[int] | np.ndarray) -> np.ndarray:
    """The int64 ``[3, num_runs]`` table of a batch; ValueError unless every run is a positive
    multiple of 16 bytes between 16-byte aligned pointers."""
    if not len(src_ptrs) == len(dst_ptrs) == len(num_bytes):
        raise ValueError("src_ptrs, dst_ptrs and num_bytes differ in length")
    table = np.empty((3, len(src_ptrs)), dtype=np.int64)
    table[0], table[1], table[2] = src_ptrs, dst_ptrs, num_bytes
    check_table(table)
    return table


def check_table(table: np.ndarray) -> None:
    """ValueError unless ``table`` is a launchable int64 ``[3, n]`` table."""
    if table.dtype != np.int64 or table.ndim != 2 or table.shape[0] != 3:
        raise ValueError(f"a run table is int64 [3, n], got {table.dtype} {table.shape}")
    if table.shape[1] and (table[2].min() <= 0 or np.any(table[2] % 16)):
        raise ValueError("every run must be a positive multiple of 16 bytes")
    if np.any(table[:2] % 16):
        raise ValueError("every pointer must be 16-byte aligned")


def blocks_per_run_for(longest_bytes: int, unroll: int | None = None,
                       num_runs: int | None = None) -> int:
    """CTAs per run: enough that each thread of the longest run does about one unrolled pass;
    with ``num_runs``, no more than ``DEVICE_GRID_CTAS`` in all (a copy between device buffers:
    there the CTAs loop over their run instead of each moving one pass and retiring)."""
    per_block = THREADS * 16 * (UNROLL if unroll is None else unroll)
    wanted = min(_MAX_BLOCKS_PER_RUN, max(1, -(-int(longest_bytes) // per_block)))
    if num_runs is None:
        return wanted
    return max(1, min(wanted, DEVICE_GRID_CTAS // max(1, num_runs)))


def launch_table(table_ptr: int, num_runs: int, stream, blocks_per_run: int,
                 unroll: int | None = None) -> None:
    """Launch ``copy_runs`` on ``stream`` over the checked table at ``table_ptr`` (device
    readable); asynchronous: record an event on ``stream`` to know it finished."""
    if num_runs <= 0:
        return
    if not 1 <= blocks_per_run <= _MAX_BLOCKS_PER_RUN or num_runs * blocks_per_run > _MAX_GRID:
        raise ValueError(f"{num_runs} runs x {blocks_per_run} CTAs is no launchable grid")
    from kernels.cuda_module import kernel  # lazily: it needs ml_dtypes, the daemon does not

    kernel("block_copy", "copy_runs", UNROLL=UNROLL if unroll is None else unroll)(
        (num_runs * blocks_per_run,), (THREADS,),
        (np.uint64(table_ptr), np.int64(num_runs), np.int32(blocks_per_run)), stream=stream)


def copy_runs(src_ptrs: Sequence[int], dst_ptrs: Sequence[int], num_bytes: int, stream=None,
              blocks_per_run: int | None = None) -> None:
    """Copy ``num_bytes`` from each ``src_ptrs[r]`` to ``dst_ptrs[r]`` in one launch on ``stream``.

    Pointers are device or pinned-host addresses; all must be 16-byte aligned and ``num_bytes`` a
    multiple of 16. The copy is asynchronous: record an event on ``stream`` to know it finished.
    """
    copy_runs_varlen(src_ptrs, dst_ptrs, np.full(len(src_ptrs), num_bytes, dtype=np.int64),
                     stream, blocks_per_run)


def copy_runs_varlen(src_ptrs: Sequence[int] | np.ndarray, dst_ptrs: Sequence[int] | np.ndarray,
                     num_bytes: Sequence[int] | np.ndarray, stream=None,
                     blocks_per_run: int | None = None) -> None:
    """``copy_runs`` with a length per run (each a positive multiple of 16, pointers 16-byte
    aligned; lists or NumPy arrays): run ``r`` copies ``num_bytes[r]`` bytes. The table goes up
    in one host-to-device copy into a device array of CuPy's stream-ordered pool."""
    import cupy as cp

    table = run_table(src_ptrs, dst_ptrs, num_bytes)
    if not table.shape[1]:
        return
    stream = stream or cp.cuda.get_current_stream()
    if blocks_per_run is None:
        blocks_per_run = blocks_per_run_for(int(table[2].max()))
    with stream:
        dev_table = cp.asarray(table)
        launch_table(dev_table.data.ptr, table.shape[1], stream, blocks_per_run)


def region_table(device_base: np.ndarray, device_stride: np.ndarray, piece_bytes: np.ndarray,
                 packed_offset: np.ndarray) -> np.ndarray:
    """The int64 ``[4, R]`` table of ``copy_pieces``: per region, block 0's piece address, the
    stride between blocks, the piece size and its offset in a packed block. ValueError unless
    every size is positive and all four are multiples of 16."""
    table = np.stack([np.asarray(a, dtype=np.int64) for a in
                      (device_base, device_stride, piece_bytes, packed_offset)])
    if table.ndim != 2 or not table.shape[1]:
        raise ValueError(f"a region table is int64 [4, R>0], got shape {table.shape}")
    if table[2].min() <= 0:
        raise ValueError("every piece must have a positive size")
    if np.any(table % 16):
        raise ValueError("piece addresses, strides, sizes and offsets must be multiples of 16")
    return table


def launch_pieces(regions_ptr: int, num_regions: int, block_ids_ptr: int, num_blocks: int,
                  packed_ptr: int, block_bytes: int, max_piece_bytes: int, pack: bool,
                  stream, unroll: int | None = None, slots_ptr: int = 0,
                  max_ctas: int | None = None) -> None:
    """Launch ``copy_pieces`` on ``stream``: ``num_blocks`` blocks (int64 ids at
    ``block_ids_ptr``, device readable) between the engine and ``packed_ptr`` (``block_bytes``
    a block, 16-byte aligned); ``pack``: engine -> packed. The region table at ``regions_ptr``
    is a device copy of a ``region_table``. ``slots_ptr`` (0: none): int64 packed positions,
    one per block, device readable (block ``j`` at ``packed_ptr + slots[j] * block_bytes``
    instead of ``j * block_bytes``). ``max_ctas``: at most that many CTAs (rounded down to
    whole pieces' worth, at least one piece's), each looping over pieces: a copy that shares
    the device with an engine's compute. Asynchronous, like ``launch_table``."""
    if num_blocks <= 0:
        return
    if block_bytes % 16 or packed_ptr % 16:
        raise ValueError("a packed buffer needs 16-byte aligned blocks")
    unroll = UNROLL if unroll is None else unroll
    blocks_per_piece = blocks_per_run_for(max_piece_bytes, unroll)
    num_pieces = num_blocks * num_regions
    grid = num_pieces * blocks_per_piece
    if max_ctas is not None:
        grid = min(grid, max(1, max_ctas // blocks_per_piece) * blocks_per_piece)
    if grid > _MAX_GRID:
        raise ValueError(f"{num_blocks} blocks x {num_regions} pieces is no launchable grid")
    from kernels.cuda_module import kernel  # lazily: it needs ml_dtypes, the daemon does not

    kernel("block_copy", "copy_pieces", UNROLL=unroll)(
        (grid,), (THREADS,),
        (np.uint64(regions_ptr), np.int32(num_regions), np.uint64(block_ids_ptr),
         np.uint64(slots_ptr), np.uint64(packed_ptr), np.int64(block_bytes),
         np.int32(blocks_per_piece), np.int32(1 if pack else 0), np.int64(num_pieces)),
        stream=stream)


def copy_pieces_reference(memory: np.ndarray, regions: np.ndarray,
                          block_ids: Sequence[int], packed_offset: int, block_bytes: int,
                          pack: bool, slots: Sequence[int] | None = None) -> None:
    """NumPy reference of ``copy_pieces`` inside one flat uint8 ``memory``: the region table's
    addresses and ``packed_offset`` are offsets into it; ``slots`` as the launch's."""
    base, stride, size, offset = (regions[i] for i in range(4))
    for j, block in enumerate(block_ids):
        at = j if slots is None else int(slots[j])
        for r in range(regions.shape[1]):
            engine = int(base[r] + block * stride[r])
            packed = int(packed_offset + at * block_bytes + offset[r])
            n = int(size[r])
            if pack:
                memory[packed:packed + n] = memory[engine:engine + n]
            else:
                memory[engine:engine + n] = memory[packed:packed + n]
