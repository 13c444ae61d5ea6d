"""Launcher for ``qkv_prepare`` (qkv_prepare.cu); reference: ``kernels.reference.qkv_prepare``."""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import BF16, FLOAT32, INT32, check, contiguous, kernel
from kernels.write_kv import check_arena

_WARPS = 4  # heads per CTA (qkv_prepare.cu)


def qkv_prepare(qkv, num_q_heads: int, num_kv_heads: int, q_norm, k_norm, eps: float,
                positions, cos_sin_cache, kv_cache, layer: int, slot_mapping):
    """bf16 ``qkv[T, (Hq + 2 Hkv) * D]`` -> rotated (and normalized) ``q[T, Hq, D]``; k and v
    go into their slots of ``layer`` in ``kv_cache``. ``q_norm``/``k_norm``: bf16 ``[D]`` or both
    None."""
    import cupy as cp

    _, num_layers, _, block_size, arena_kv_heads, head_dim = check_arena(kv_cache, layer)
    qkv, positions, slot_mapping = contiguous(qkv), contiguous(positions), contiguous(slot_mapping)
    check(qkv, "qkv", BF16, 2)
    check(positions, "positions", INT32, 1)
    check(slot_mapping, "slot_mapping", INT32, 1)
    check(cos_sin_cache, "cos_sin_cache", FLOAT32, 2)
    num_tokens = qkv.shape[0]
    num_heads = num_q_heads + 2 * num_kv_heads
    if num_kv_heads != arena_kv_heads or qkv.shape[1] != num_heads * head_dim:
        raise ValueError(f"qkv {qkv.shape} does not hold {num_q_heads} + 2 x {num_kv_heads} heads "
                         f"of the arena's head_dim {head_dim} ({arena_kv_heads} KV heads)")
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"positions {positions.shape} / slots {slot_mapping.shape} do not match "
                         f"{num_tokens} tokens")
    if head_dim % 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache {cos_sin_cache.shape} does not fit head_dim {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None:
            check(weight, name, BF16, 1)
            if weight.shape[0] != head_dim:
                raise ValueError(f"{name} has {weight.shape[0]} values for head_dim {head_dim}")
    q = cp.empty((num_tokens, num_q_heads, head_dim), dtype=BF16)
    if num_tokens == 0:
        return q
    null = np.uint64(0)
    kernel("qkv_prepare", "qkv_prepare", HEAD_DIM=head_dim)(
        (num_tokens, -(-num_heads // _WARPS)), (32 * _WARPS,),
        (qkv, null if q_norm is None else q_norm, null if k_norm is None else k_norm,
         np.float32(eps), positions, cos_sin_cache, slot_mapping, q, kv_cache,
         np.int32(num_q_heads), np.int32(num_kv_heads), np.int32(num_layers), np.int32(layer),
         np.int32(block_size)))
    return q
