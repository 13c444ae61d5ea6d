"""Launchers for ``paged_prefill``, ``paged_decode`` and ``combine_splits`` (attention.cu);
references: ``kernels.reference.paged_attention_prefill`` / ``paged_attention_decode``."""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from kernels.cuda_module import BF16, FLOAT32, INT32, check, contiguous, kernel
from kernels.write_kv import check_arena

_PREFILL_WARPS = 8  # with 32 query rows each (two MMA row tiles): 256-row tiles (attention.cu)
_PREFILL_MT = 2
_PREFILL_BN = 64
_SHORT_QUERY_ROWS = 128  # below this many query rows per sequence (on average): 16-row warps
_MIN_SPLIT_TILES = 4  # key tiles a prefill context split covers at least
_BN = 64  # keys per tile
_MAX_DECODE_GROUP = 16  # query heads per KV head that one decode warp holds
_LOG2E = 1.4426950408889634


def _smem_bytes(head_dim: int, num_rows: int, keys_per_tile: int = _BN) -> int:
    return (num_rows + 4 * keys_per_tile) * (head_dim + 8) * 2  # Q + double-buffered K and V


@cache
def _function(name: str, head_dim: int, use_ldmatrix: bool, smem_bytes: int,
              prefill_warps: int = _PREFILL_WARPS, prefill_mt: int = _PREFILL_MT,
              prefill_bn: int = _PREFILL_BN):
    fn = kernel("attention", name, HEAD_DIM=head_dim, USE_LDMATRIX=int(use_ldmatrix),
                PREFILL_WARPS=prefill_warps, PREFILL_MT=prefill_mt, PREFILL_BN=prefill_bn)
    if smem_bytes > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn


@cache
def _num_sms() -> int:
    import cupy as cp

    return cp.cuda.Device().attributes["MultiProcessorCount"]


def _shift(block_size: int) -> int:
    """log2(block_size) for a power of two (the kernels shift), else -1 (they divide)."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1


def _check_common(q, kv_cache, layer: int, block_tables, context_lens):
    shape = check_arena(kv_cache, layer)
    check(q, "q", BF16, 3)
    check(block_tables, "block_tables", INT32, 2)
    check(context_lens, "context_lens", INT32, 1)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = shape[4]
    if head_dim != shape[5] or head_dim % 16 or head_dim > 256:
        raise ValueError(f"head_dim {head_dim} must match the arena's {shape[5]}, be a multiple "
                         "of 16 and at most 256")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads}")
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables {block_tables.shape} and context_lens "
                         f"{context_lens.shape} disagree on the sequence count")
    return shape


def prefill_splits(num_ctas: int, max_keys: int, keys_per_tile: int = _PREFILL_BN
                   ) -> tuple[int, int]:
    """(num_splits, keys_per_split) for a prefill grid of ``num_ctas`` (heads x query tiles)
    over contexts of at most ``max_keys``: split the context when the tiles alone fill less than
    the GPU about four times over, keeping at least ``_MIN_SPLIT_TILES`` key tiles per split."""
    num_tiles = max(1, -(-max_keys // keys_per_tile))
    wanted = -(-4 * _num_sms() // max(1, num_ctas))
    num_splits = max(1, min(wanted, num_tiles // _MIN_SPLIT_TILES))
    keys_per_split = -(-num_tiles // num_splits) * keys_per_tile
    return -(-max_keys // keys_per_split) if max_keys else 1, keys_per_split


def paged_attention_prefill(q, kv_cache, layer: int, block_tables, cu_seqlens_q, context_lens,
                            scale: float, use_ldmatrix: bool = True,
                            num_warps: int = _PREFILL_WARPS, rows_per_warp: int | None = None,
                            keys_per_tile: int = _PREFILL_BN, keys_per_split: int | None = None):
    """Causal varlen GQA attention of bf16 ``q[T, Hq, D]`` over the paged K/V -> ``[T, Hq, D]``.
    ``use_ldmatrix``, ``num_warps`` (4 or 8), ``rows_per_warp`` (16 or 32) and ``keys_per_tile``
    (32 or 64) pick kernel variants with the same results, for tests and tuning. By default long
    queries get 256-row tiles (8 warps of 32 rows) and short ones (a few new tokens over a long
    cached prefix: under 128 rows per sequence on average) 128-row tiles of 16-row warps, where
    32-row warps would compute mostly padding against every key. Short queries whose tiles are
    too few to fill the GPU also get their context split over CTAs, the partials merged
    (``prefill_splits``); ``keys_per_split`` (a multiple of ``keys_per_tile``) forces a split
    size, for tests."""
    import cupy as cp

    q, block_tables = contiguous(q), contiguous(block_tables)
    cu_seqlens_q, context_lens = contiguous(cu_seqlens_q), contiguous(context_lens)
    shape = _check_common(q, kv_cache, layer, block_tables, context_lens)
    check(cu_seqlens_q, "cu_seqlens_q", INT32, 1)
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q needs {num_seqs + 1} entries, has {cu_seqlens_q.shape[0]}")
    num_tokens, num_q_heads, head_dim = q.shape
    out = cp.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    short = num_tokens < _SHORT_QUERY_ROWS * num_seqs
    if rows_per_warp is None:
        rows_per_warp = 16 if short else 16 * _PREFILL_MT
    if num_warps not in (4, 8):
        raise ValueError(f"num_warps must be 4 or 8, got {num_warps}")
    if rows_per_warp not in (16, 32):
        raise ValueError(f"rows_per_warp must be 16 or 32, got {rows_per_warp}")
    if keys_per_tile not in (32, 64):
        raise ValueError(f"keys_per_tile must be 32 or 64, got {keys_per_tile}")
    rows_per_cta = rows_per_warp * num_warps
    # sum over sequences of ceil(q_len / rows) <= ceil(T / rows) + B - 1: no host sync needed.
    num_tiles = -(-num_tokens // rows_per_cta) + num_seqs - 1
    if num_tiles > 65535:
        raise ValueError(f"{num_tokens} tokens in {num_seqs} sequences need too many tiles")
    smem = _smem_bytes(head_dim, rows_per_cta, keys_per_tile)
    fn = _function("paged_prefill", head_dim, use_ldmatrix, smem, num_warps, rows_per_warp // 16,
                   keys_per_tile)
    _, num_layers, _, block_size, num_kv_heads, _ = shape
    max_keys = block_tables.shape[1] * block_size  # the table's width bounds every context
    if keys_per_split is None:  # long queries fill the GPU with their own tiles
        num_splits, keys_per_split = prefill_splits(num_q_heads * num_tiles, max_keys,
                                                    keys_per_tile) if short else (1, max_keys)
    else:
        if keys_per_split <= 0 or keys_per_split % keys_per_tile:
            raise ValueError(f"keys_per_split {keys_per_split} must be a positive multiple of "
                             f"keys_per_tile {keys_per_tile}")
        num_splits = max(1, -(-max_keys // keys_per_split))
    if num_splits > 65535:
        raise ValueError(f"{num_splits} context splits are too many for one grid")
    split_rows = num_tokens * num_q_heads
    if num_splits > 1:
        part_o = cp.empty((num_splits, num_tokens, num_q_heads, head_dim), dtype=FLOAT32)
        part_ml = cp.empty((num_splits, num_tokens, num_q_heads, 2), dtype=FLOAT32)
    else:
        part_o = part_ml = np.uint64(0)  # unused null pointers
    fn((num_q_heads, num_tiles, num_splits), (32 * num_warps,),
       (q, kv_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_ml,
        np.int32(split_rows), np.int32(num_seqs), np.int32(block_tables.shape[1]),
        np.int32(num_q_heads), np.int32(num_layers), np.int32(layer), np.int32(block_size),
        np.int32(_shift(block_size)), np.int32(num_kv_heads), np.int32(keys_per_split),
        np.float32(scale * _LOG2E)), shared_mem=smem)
    if num_splits > 1:
        _combine(part_o, part_ml, out, num_splits, split_rows, head_dim, use_ldmatrix)
    return out


def _combine(part_o, part_ml, out, num_splits: int, num_rows: int, head_dim: int,
             use_ldmatrix: bool) -> None:
    combine = _function("combine_splits", head_dim, use_ldmatrix, 0)
    combine((num_rows,), (min(head_dim, 128),),
            (part_o, part_ml, out, np.int32(num_splits), np.int32(num_rows)))


def decode_splits(num_seqs: int, num_kv_heads: int, max_keys: int) -> tuple[int, int]:
    """(num_splits, keys_per_split): enough warps to fill the GPU about twice, whole tiles each."""
    num_tiles = max(1, -(-max_keys // _BN))
    wanted = max(1, -(-2 * _num_sms() // (num_seqs * num_kv_heads)))
    num_splits = min(wanted, num_tiles)
    keys_per_split = math.ceil(num_tiles / num_splits) * _BN
    return -(-max_keys // keys_per_split) if max_keys else 1, keys_per_split


def paged_attention_decode(q, kv_cache, layer: int, block_tables, context_lens, scale: float,
                           use_ldmatrix: bool = True):
    """One query per sequence, bf16 ``q[B, Hq, D]``, over its whole paged context -> ``[B, Hq, D]``
    (flash-decoding: the context is split across warps, then the partials are merged)."""
    import cupy as cp

    q, block_tables = contiguous(q), contiguous(block_tables)
    context_lens = contiguous(context_lens)
    shape = _check_common(q, kv_cache, layer, block_tables, context_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    if context_lens.shape[0] != num_seqs:
        raise ValueError(f"q has {num_seqs} rows for {context_lens.shape[0]} sequences")
    _, num_layers, _, block_size, num_kv_heads, _ = shape
    if num_q_heads // num_kv_heads > _MAX_DECODE_GROUP:  # rows do not fit one warp's tile
        cu_seqlens = cp.arange(num_seqs + 1, dtype=np.int32)
        return paged_attention_prefill(q, kv_cache, layer, block_tables, cu_seqlens,
                                       context_lens, scale, use_ldmatrix)
    out = cp.empty_like(q)
    if num_seqs == 0:
        return out
    num_splits, keys_per_split = decode_splits(num_seqs, num_kv_heads,
                                               block_tables.shape[1] * block_size)
    if num_splits > 1:
        part_o = cp.empty((num_splits, num_seqs, num_q_heads, head_dim), dtype=FLOAT32)
        part_ml = cp.empty((num_splits, num_seqs, num_q_heads, 2), dtype=FLOAT32)
    else:
        part_o = part_ml = np.uint64(0)  # unused null pointers
    smem = _smem_bytes(head_dim, 16)
    fn = _function("paged_decode", head_dim, use_ldmatrix, smem)
    fn((num_splits, num_kv_heads, num_seqs), (32,),
       (q, kv_cache, block_tables, context_lens, out, part_o, part_ml,
        np.int32(block_tables.shape[1]), np.int32(num_q_heads), np.int32(num_layers),
        np.int32(layer), np.int32(block_size), np.int32(_shift(block_size)),
        np.int32(num_kv_heads), np.int32(keys_per_split), np.float32(scale * _LOG2E)),
       shared_mem=smem)
    if num_splits > 1:
        _combine(part_o, part_ml, out, num_splits, num_seqs * num_q_heads, head_dim,
                 use_ldmatrix)
    return out
