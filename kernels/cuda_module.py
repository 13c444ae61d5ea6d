"""Compile a kernel family's ``.cu`` once per set of defines (CuPy RawModule, NVRTC) + checks.

NVRTC here cannot include the C++ standard library and CuPy's on-disk cache keys on the source
text, so ``#include "common.cuh"`` is inlined before compiling: editing a header recompiles too.

A compile costs about 2.5 s on a machine whose CuPy cache is cold (a few ms from the
cache), so each one is reported to the build logs that ``watch`` (``BuildKind.KERNEL_MODULE``):
after the engine says ready, one is a stall some request waited for. The engine's warm-up
(``kernels/kernel_warm_up.py``) compiles every module a request can reach.
"""

from __future__ import annotations

import re
import time
import weakref
from functools import cache
from pathlib import Path

import ml_dtypes
import numpy as np

from kernels.build_log import KERNEL_MODULE, BuildLog

BF16 = np.dtype(ml_dtypes.bfloat16)
INT32 = np.dtype(np.int32)
FLOAT32 = np.dtype(np.float32)

_DIR = Path(__file__).parent
_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


def source(name: str, defines: tuple[tuple[str, int], ...] = ()) -> str:
    """The text NVRTC compiles: ``#define``s, then ``name.cu`` with local headers inlined."""
    text = (_DIR / f"{name}.cu").read_text()
    text = _INCLUDE.sub(lambda m: (_DIR / m.group(1)).read_text(), text)
    head = "".join(f"#define {key} {value}\n" for key, value in defines)
    return head + text


_watchers: weakref.WeakSet[BuildLog] = weakref.WeakSet()


def watch(builds: BuildLog) -> None:
    """Report every module compiled in this process from now on to ``builds`` (held weakly)."""
    _watchers.add(builds)


@cache
def _module(name: str, defines: tuple[tuple[str, int], ...]):
    import cupy as cp

    start = time.perf_counter()
    module = cp.RawModule(code=source(name, defines), options=("-std=c++17",))
    module.compile()  # now, not at the first launch: the time is this module's
    seconds = time.perf_counter() - start
    for builds in list(_watchers):
        builds.record(KERNEL_MODULE, (name, defines), seconds)
    return module


def kernel(name: str, function: str, **defines: int):
    """The compiled ``function`` of ``kernels/name.cu`` (cached per defines)."""
    return _module(name, tuple(sorted(defines.items()))).get_function(function)


def check(x, name: str, dtype: np.dtype, ndim: int | None = None) -> None:
    """Raise unless ``x`` is a C-contiguous CuPy array of ``dtype`` (and ``ndim``)."""
    import cupy as cp

    if not isinstance(x, cp.ndarray):
        raise TypeError(f"{name} must be a cupy array, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def contiguous(x):
    """``x`` itself when C-contiguous, else a contiguous copy (kernels index rows densely)."""
    import cupy as cp

    return x if x.flags.c_contiguous else cp.ascontiguousarray(x)


def num_blocks(n: int, per_block: int) -> int:
    return max(1, -(-n // per_block))
