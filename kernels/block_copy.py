"""Launcher for ``copy_runs`` (block_copy.cu) and its NumPy reference."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np

_SOURCE = Path(__file__).with_name("block_copy.cu")
_THREADS = 256


@cache
def _kernel():
    import cupy as cp

    module = cp.RawModule(code=_SOURCE.read_text(), options=("-std=c++17",))
    return module.get_function("copy_runs")


def copy_runs(src_ptrs: Sequence[int], dst_ptrs: Sequence[int], num_bytes: int, stream=None,
              blocks_per_run: int = 16) -> None:
    """Copy ``num_bytes`` from each ``src_ptrs[r]`` to ``dst_ptrs[r]`` in one launch on ``stream``.

    Pointers are device or pinned-host addresses; all must be 16-byte aligned and ``num_bytes`` a
    multiple of 16. The copy is asynchronous: record an event on ``stream`` to know it finished.
    """
    copy_runs_varlen(src_ptrs, dst_ptrs, [num_bytes] * len(src_ptrs), stream, blocks_per_run)


def copy_runs_varlen(src_ptrs: Sequence[int], dst_ptrs: Sequence[int],
                     num_bytes: Sequence[int], stream=None, blocks_per_run: int = 8) -> None:
    """``copy_runs`` with a length per run (each a positive multiple of 16, pointers 16-byte
    aligned): run ``r`` copies ``num_bytes[r]`` bytes. Asynchronous on ``stream``."""
    import cupy as cp

    if not len(src_ptrs) == len(dst_ptrs) == len(num_bytes):
        raise ValueError("src_ptrs, dst_ptrs and num_bytes differ in length")
    if not src_ptrs:
        return
    if any(n <= 0 or n % 16 for n in num_bytes):
        raise ValueError("every run must be a positive multiple of 16 bytes")
    if any(p % 16 for p in src_ptrs) or any(p % 16 for p in dst_ptrs):
        raise ValueError("every pointer must be 16-byte aligned")
    if len(src_ptrs) > 65535:
        raise ValueError("at most 65535 runs per launch")
    stream = stream or cp.cuda.get_current_stream()
    with stream:
        table = cp.asarray(np.asarray([list(src_ptrs), list(dst_ptrs), list(num_bytes)],
                                      dtype=np.uint64))
        _kernel()((blocks_per_run, len(src_ptrs)), (_THREADS,), (table[0], table[1], table[2]),
                  stream=stream)


def copy_runs_reference(src: Sequence[np.ndarray], dst: Sequence[np.ndarray]) -> None:
    """NumPy reference: ``dst[r][:] = src[r]`` for every run (byte views of equal size)."""
    for s, d in zip(src, dst, strict=True):
        d.view(np.uint8)[:] = s.view(np.uint8)
