"""Launcher for ``gather_kv`` (gather_kv.cu): one layer's K/V of the blocks in a table, dense.

Reference: ``gather_kv_reference`` below (NumPy fancy indexing); the GPU test compares bit-exact.
"""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import INT32, check, contiguous, kernel, num_blocks
from kernels.write_kv import check_arena

_THREADS = 256
# Keys copied past a sequence's context length: at least the widest key tile cuDNN's SDPA loads
# whole (64-128 keys), so its last, partial tile reads copied rows only.
MARGIN_KEYS = 256


def copied_keys(context_len: int, block_size: int, width: int) -> int:
    """How many leading rows of a sequence ``gather_kv`` copies: the blocks that start before
    ``context_len + MARGIN_KEYS``, at most the table's ``width`` blocks."""
    return min(width, -(-(int(context_len) + MARGIN_KEYS) // block_size)) * block_size


def gather_kv_reference(kv_cache: np.ndarray, layer: int, tables: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(k, v), each ``[B, W * block_size, Hkv, D]``: row ``w * block_size + s`` of sequence ``b``
    is slot ``s`` of block ``tables[b, w]`` of ``layer`` (``gather_kv`` copies the rows before
    ``copied_keys`` of each sequence; compare those)."""
    num_seqs, width = tables.shape
    _, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    shape = (num_seqs, width * block_size, num_kv_heads, head_dim)
    return (kv_cache[tables, layer, 0].reshape(shape), kv_cache[tables, layer, 1].reshape(shape))


def gather_kv(kv_cache, layer: int, tables, context_lens=None, k_out=None, v_out=None):
    """The dense (k, v) of ``tables[B, W]``'s blocks of ``layer``; ``k_out``/``v_out`` (each
    ``[B, W * block_size, Hkv, D]``, the arena's dtype) are reused when given.
    ``context_lens[B]`` (int32, on the device): only each sequence's first ``copied_keys`` rows
    are copied, the rest of its rows keep what the buffers held (None: every row)."""
    import cupy as cp

    _, num_layers, _, block_size, num_kv_heads, head_dim = check_arena(kv_cache, layer)
    tables = contiguous(tables)
    check(tables, "tables", INT32, 2)
    num_seqs, width = tables.shape
    if context_lens is None:
        context_lens = cp.full((num_seqs,), width * block_size, dtype=cp.int32)
    context_lens = contiguous(context_lens)
    check(context_lens, "context_lens", INT32, 1)
    if context_lens.shape[0] != num_seqs:
        raise ValueError(f"context_lens has {context_lens.shape[0]} entries, the table "
                         f"{num_seqs} rows")
    shape = (num_seqs, width * block_size, num_kv_heads, head_dim)
    if k_out is None:
        k_out = cp.empty(shape, dtype=kv_cache.dtype)
    if v_out is None:
        v_out = cp.empty(shape, dtype=kv_cache.dtype)
    for name, out in (("k_out", k_out), ("v_out", v_out)):
        check(out, name, kv_cache.dtype, 4)
        if out.shape != shape:
            raise ValueError(f"{name} has shape {out.shape}, the table needs {shape}")
    block_bytes = block_size * num_kv_heads * head_dim * kv_cache.itemsize
    if block_bytes % 16:
        raise ValueError(f"a block plane of {block_bytes} bytes is not whole 16-byte words")
    block_words = block_bytes // 16
    num_words = num_seqs * width * block_words
    if num_words:
        kernel("gather_kv", "gather_kv")(
            (num_blocks(num_words, _THREADS),), (_THREADS,),
            (kv_cache, tables, k_out, v_out, context_lens, np.int64(num_words),
             np.int32(num_layers), np.int32(layer), np.int32(block_words), np.int32(width),
             np.int32(block_size), np.int32(MARGIN_KEYS)))
    return k_out, v_out
