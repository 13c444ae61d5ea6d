"""Which way a batch of host <-> device runs crosses the bus: a pure choice from the batch's
shape, the host memory and the copier's ``CopySettings`` (``CudaCopier`` asks it per batch).

Many small runs (vLLM's layout: one 32 KiB piece per layer and K/V) go by ``settings.small_runs``
(a ``cudaMemcpyAsync`` per 32 KiB run reaches ~6 GB/s, a kernel reading mapped pinned memory ~46
GB/s, H100); large runs (kvengine's block-major arena: one 2+ MB run per block) by
``settings.large_runs``, on the copy engines by default. A save takes no kernel unless
``settings.save_kernels``: a kernel in the daemon's CUDA context time-slices against the engine's
step, and no request waits for a save.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstore.engines.copy_settings import CopyMethod, CopySettings
from kvstore.engines.device_staging import staged_sides
from kvstore.engines.run_arrays import RunArrays

GATHER_MIN_RUNS = 8  # batches with fewer runs never go through the copy kernel
GATHER_MAX_MEAN_RUN_BYTES = 512 << 10  # a batch whose runs average at most this is "small"


def aligned(runs: RunArrays) -> bool:
    """Every run's addresses and size are multiples of 16 bytes (the kernels' loads)."""
    return not np.any((runs.src_ptrs | runs.dst_ptrs | runs.num_bytes) & 15)


def host_method(settings: CopySettings, merged: RunArrays, *, save: bool,
                host_addressable: Callable[[], bool], max_slot_bytes: int,
                batch_available: bool) -> CopyMethod:
    """The method for the (coalesced) runs ``merged``: ``save`` for device to host;
    ``host_addressable()`` whether the host side is page-locked and mapped at the same address
    (every method but memcpy needs it; a driver call, made only where it decides);
    ``max_slot_bytes`` a staging slot's size (a larger run goes by the kernel);
    ``batch_available`` when the driver has ``cuMemcpyBatchAsync``. The kernel and the staged
    path need aligned runs (the kernel 8+ of them), else a driver batch takes them, else
    memcpy. Large runs go staged only where that merges them (``_staging_merges``), else by
    a driver batch."""
    if len(merged) < 2:
        return CopyMethod.MEMCPY
    small = merged.total_bytes <= GATHER_MAX_MEAN_RUN_BYTES * len(merged)
    method = settings.small_runs if small else settings.large_runs
    if method is CopyMethod.MEMCPY or not host_addressable():
        return CopyMethod.MEMCPY
    if method is CopyMethod.STAGED and not small and \
            not _staging_merges(merged, save, max_slot_bytes):
        method = CopyMethod.BATCH  # large runs staged gain only fewer, longer bus copies
    kernels = not save or settings.save_kernels
    if method in (CopyMethod.KERNEL, CopyMethod.STAGED) and not (kernels and aligned(merged)):
        method = CopyMethod.BATCH
    # a run larger than a staging slot goes by the kernel: the ring keeps its budget
    if method is CopyMethod.STAGED and int(merged.num_bytes.max()) > max_slot_bytes:
        method = CopyMethod.KERNEL
    if method is CopyMethod.KERNEL and len(merged) < GATHER_MIN_RUNS:
        method = CopyMethod.BATCH
    if method is CopyMethod.BATCH and not batch_available:
        return CopyMethod.MEMCPY
    return method


def _staging_merges(merged: RunArrays, save: bool, max_slot_bytes: int) -> bool:
    """Whether large runs staged cross the bus in fewer copies than they are: their host side
    continues itself where the engine's blocks do not (a restore of blocks saved together into
    shuffled engine blocks), and no run outgrows a staging slot's worth of continuing blocks
    (consecutive on both sides, one copy engine call moves it already)."""
    if int(merged.num_bytes.max()) > max_slot_bytes:
        return False
    bus, _ = staged_sides(merged, 0, to_device=not save)  # the bus copies staging would make
    return len(bus) < len(merged)
