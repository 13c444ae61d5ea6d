"""Launcher for ``rms_norm`` (rms_norm.cu); reference: ``kernels.reference.rms_norm``."""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import BF16, check, contiguous, kernel, num_blocks

_ROWS_PER_CTA = 4  # one warp per row


def rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm of bf16 ``x[..., H]`` with ``weight[H]``; with ``residual`` (shape of ``x``) the
    fused add first. Returns ``(out, new_residual | None)``, new arrays."""
    import cupy as cp

    x = contiguous(x)
    check(x, "x", BF16)
    check(weight, "weight", BF16, 1)
    hidden = x.shape[-1]
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} elements, rows have {hidden}")
    new_residual = None
    if residual is not None:
        residual = contiguous(residual)
        check(residual, "residual", BF16)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {residual.shape} differs from x {x.shape}")
        new_residual = cp.empty_like(x)
    out = cp.empty_like(x)
    num_rows = x.size // hidden if hidden else 0
    if num_rows:
        grid = (num_blocks(num_rows, _ROWS_PER_CTA),)
        kernel("rms_norm", "rms_norm")(grid, (32 * _ROWS_PER_CTA,),
                                       (x, _ptr(residual), weight, out, _ptr(new_residual),
                                        np.int64(num_rows), np.int32(hidden), np.float32(eps)))
    return out, new_residual


def _ptr(x):
    """A device array, or a null pointer for ``None``."""
    return np.uint64(0) if x is None else x
