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
    staged_large = CopySettings(large_runs="staged")
    assert _method(staged_large, _runs(16, SLOT + 16), save=False) is CopyMethod.KERNEL
    assert _method(staged_large, _runs(16, SLOT + 16), save=True) is CopyMethod.BATCH
