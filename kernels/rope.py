"""Launcher for ``rope`` (rope.cu); reference: ``kernels.reference.rope``."""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import BF16, FLOAT32, INT32, check, contiguous, kernel, num_blocks

_THREADS = 256


def rope(q, k, positions, cos_sin_cache):
    """NeoX rotary embedding of bf16 ``q[T, Hq, D]``, ``k[T, Hkv, D]`` at int32 ``positions[T]``
    with the float32 ``cos_sin_cache[max_pos, D]``; returns new ``(q, k)``."""
    import cupy as cp

    q, k, positions = contiguous(q), contiguous(k), contiguous(positions)
    check(q, "q", BF16, 3)
    check(k, "k", BF16, 3)
    check(positions, "positions", INT32, 1)
    check(cos_sin_cache, "cos_sin_cache", FLOAT32, 2)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError(f"q {q.shape}, k {k.shape} and positions {positions.shape} disagree")
    if head_dim % 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache {cos_sin_cache.shape} does not fit head_dim {head_dim}")
    q_out, k_out = cp.empty_like(q), cp.empty_like(k)
    total = num_tokens * (num_q_heads + k.shape[1]) * (head_dim // 2)
    if total:
        kernel("rope", "rope")((num_blocks(total, _THREADS),), (_THREADS,),
                               (q, k, positions, cos_sin_cache, q_out, k_out, np.int32(num_tokens),
                                np.int32(num_q_heads), np.int32(k.shape[1]), np.int32(head_dim)))
    return q_out, k_out
