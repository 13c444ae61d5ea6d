"""Launcher for ``write_kv`` (write_kv.cu); reference: ``kernels.reference.write_kv``."""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import BF16, INT32, check, contiguous, kernel, num_blocks

_THREADS = 256


def check_arena(kv_cache, layer: int) -> tuple[int, ...]:
    """The arena's shape after checking it is a bf16 6-dim array holding ``layer``."""
    check(kv_cache, "kv_cache", BF16, 6)
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} outside the arena's {kv_cache.shape[1]} layers")
    return kv_cache.shape


def write_kv(kv_cache, layer: int, k, v, slot_mapping) -> None:
    """Scatter bf16 ``k``/``v[T, Hkv, D]`` into ``kv_cache`` slots of ``layer``, in place."""
    _, num_layers, _, block_size, num_kv_heads, head_dim = check_arena(kv_cache, layer)
    k, v, slot_mapping = contiguous(k), contiguous(v), contiguous(slot_mapping)
    check(k, "k", BF16, 3)
    check(v, "v", BF16, 3)
    check(slot_mapping, "slot_mapping", INT32, 1)
    num_tokens = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k {k.shape} / v {v.shape} do not match the arena's "
                         f"[{num_kv_heads}, {head_dim}] rows")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
    total = num_tokens * num_kv_heads * head_dim // 8
    if total:
        kernel("write_kv", "write_kv")((num_blocks(total, _THREADS),), (_THREADS,),
                                       (kv_cache, k, v, slot_mapping, np.int32(num_tokens),
                                        np.int32(num_layers), np.int32(layer),
                                        np.int32(block_size), np.int32(num_kv_heads),
                                        np.int32(head_dim)))
