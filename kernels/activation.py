"""Launchers for ``silu_and_mul`` and ``add_bias`` (activation.cu); references:
``kernels.reference.silu_and_mul`` and ``x + bias``."""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import BF16, check, contiguous, kernel, num_blocks

_THREADS = 256


def silu_and_mul(x):
    """bf16 ``x[T, 2I]`` = [gate | up] -> ``silu(gate) * up`` ``[T, I]``."""
    import cupy as cp

    x = contiguous(x)
    check(x, "x", BF16, 2)
    if x.shape[1] % 2:
        raise ValueError(f"x must have an even last dim, got {x.shape}")
    num_rows, width = x.shape[0], x.shape[1] // 2
    out = cp.empty((num_rows, width), dtype=BF16)
    total = num_rows * (width // 8 if width % 8 == 0 else width)
    if total:
        kernel("activation", "silu_and_mul")((num_blocks(total, _THREADS),), (_THREADS,),
                                             (x, out, np.int64(num_rows), np.int32(width)))
    return out


def add_bias_(x, bias):
    """``x[T, N] += bias[N]`` in place (bf16); returns ``x``."""
    check(x, "x", BF16, 2)
    check(bias, "bias", BF16, 1)
    if bias.shape[0] != x.shape[1]:
        raise ValueError(f"bias {bias.shape} does not fit x {x.shape}")
    if x.size:
        kernel("activation", "add_bias")((num_blocks(x.size, _THREADS),), (_THREADS,),
                                         (x, bias, np.int64(x.shape[0]), np.int32(x.shape[1])))
    return x
