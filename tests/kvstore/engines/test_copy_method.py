"""How a host <-> device batch crosses the bus (CPU: the choice is pure; the methods themselves
run in the GPU tests): saves stay off kernels unless asked, loads take the configured method,
and every fallback (pageable host memory, unaligned runs, few runs, a run past a staging slot, a
driver without batches) lands where the copier's contract says."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.engines.copy_method import GATHER_MIN_RUNS, host_method
from kvstore.engines.copy_settings import CopyMethod, CopySettings
from kvstore.engines.run_arrays import RunArrays

PIECE = 32 << 10  # vLLM's piece
BLOCK = 2_359_296  # kvengine's block-major block
SLOT = 32 << 20


def _runs(num_runs: int, num_bytes: int, misalign: int = 0) -> RunArrays:
    src = 0x7000_0000_0000 + np.arange(num_runs, dtype=np.int64) * 2 * num_bytes
    dst = 0x1000_0000_0000 + np.arange(num_runs, dtype=np.int64) * 3 * num_bytes + misalign
    return RunArrays(src, dst, np.full(num_runs, num_bytes, dtype=np.int64))


def _method(settings: CopySettings = CopySettings(), runs: RunArrays | None = None, *,
            save: bool, addressable: bool = True, batch: bool = True) -> CopyMethod:
    return host_method(settings, _runs(64, PIECE) if runs is None else runs, save=save,
                       host_addressable=lambda: addressable, max_slot_bytes=SLOT,
                       batch_available=batch)


def test_by_default_a_save_of_small_pieces_takes_no_kernel_and_a_load_is_staged() -> None:
    assert _method(save=True) is CopyMethod.BATCH
    assert _method(save=False) is CopyMethod.STAGED


def test_save_kernels_lets_a_save_take_the_small_runs_method() -> None:
    assert _method(CopySettings(save_kernels=True), save=True) is CopyMethod.STAGED
    kernel = CopySettings(small_runs="kernel", save_kernels=True)
    assert _method(kernel, save=True) is CopyMethod.KERNEL
    assert _method(CopySettings(small_runs="kernel"), save=True) is CopyMethod.BATCH


@pytest.mark.parametrize("save", [True, False])
def test_large_blocks_go_on_the_copy_engines_either_way(save: bool) -> None:
    assert _method(runs=_runs(16, BLOCK), save=save) is CopyMethod.BATCH


@pytest.mark.parametrize("save", [True, False])
def test_fallbacks(save: bool) -> None:
    assert _method(save=save, addressable=False) is CopyMethod.MEMCPY  # pageable host memory
    assert _method(runs=_runs(1, PIECE), save=save) is CopyMethod.MEMCPY  # one run
    assert _method(save=save, batch=False) is (CopyMethod.MEMCPY if save else
                                                CopyMethod.STAGED)  # an old driver
    assert _method(runs=_runs(64, PIECE, misalign=8), save=save) is CopyMethod.BATCH
    few = CopySettings(small_runs="kernel", save_kernels=True)
    assert _method(few, _runs(GATHER_MIN_RUNS - 1, PIECE), save=save) is CopyMethod.BATCH
    assert _method(few, _runs(GATHER_MIN_RUNS, PIECE), save=save) is CopyMethod.KERNEL


def test_a_staged_run_larger_than_a_slot_goes_by_the_kernel() -> None:
    staged_small = CopySettings(small_runs="staged")
    pieces = _runs(256, PIECE)
    pieces.num_bytes[0] = SLOT + 16  # one outgrown run among small ones
    assert _method(staged_small, pieces, save=False) is CopyMethod.KERNEL
    assert _method(staged_small, pieces, save=True) is CopyMethod.BATCH


def _restore(num_blocks: int, host_stretch: int, seed: int = 3) -> RunArrays:
    """Blocks read from pool slots in stretches of ``host_stretch`` continuing slots, into
    shuffled engine blocks (nothing continues on both sides)."""
    starts = 0x7000_0000_0000 + np.arange(num_blocks, dtype=np.int64) * BLOCK
    gaps = (np.arange(num_blocks, dtype=np.int64) // host_stretch) * BLOCK  # a hole per stretch
    engine = np.random.default_rng(seed).permutation(4 * num_blocks).astype(np.int64)[:num_blocks]
    return RunArrays(starts + gaps, 0x1000_0000_0000 + engine * 2 * BLOCK,
                     np.full(num_blocks, BLOCK, dtype=np.int64))


def test_large_runs_go_staged_only_where_that_merges_their_bus_copies() -> None:
    """--copy-large-runs staged: a restore of blocks saved together (continuing pool slots)
    into shuffled engine blocks crosses the bus in a copy per stretch of slots; blocks whose
    slots do not continue, or that continue on both sides past a slot, stay one driver batch."""
    staged = CopySettings(large_runs="staged")
    assert _method(staged, _restore(64, 16), save=False) is CopyMethod.STAGED
    assert _method(staged, _restore(64, 1), save=False) is CopyMethod.BATCH
    assert _method(staged, _restore(64, 16), save=True) is CopyMethod.BATCH  # no save kernels
    both = _runs(4, 14 * BLOCK)  # continuing on both sides: coalesced runs past a slot
    assert _method(staged, both, save=False) is CopyMethod.BATCH
    assert _method(CopySettings(), _restore(64, 16), save=False) is CopyMethod.BATCH
