"""Launchers for ``split_prefill.cu``: the index arrays, query copies and the log-sum-exp merge
of a prefill split over its context (the cuDNN calls between them: ``kernels/cudnn_split.py``).

A short query (a chat turn's last few dozen tokens) over a long cached context gives cuDNN only
(heads x query tiles) = ~32 CTAs per layer on 132 SMs, each walking the whole context. Split
into ``num_slices`` slices of whole blocks, the prefix before the first query row is attended
unmasked slice by slice, the rest (the tail: the query's own tokens and the partial block before
them) causally, and the partials are merged by their log-sum-exp (natural log).

References: ``split_meta_reference``, ``merge_partials_reference`` and, for the whole scheme,
``split_prefill_reference`` (equal to ``reference.paged_attention_prefill``: a CPU test).
"""

from __future__ import annotations

import numpy as np

from kernels import reference as ref

_THREADS = 256


def tail_width(max_rows: int, block_size: int) -> int:
    """Blocks of a tail table: at most ``max_rows`` query tokens plus a partial block."""
    return -(-(max_rows + block_size - 1) // block_size)


# -- references ------------------------------------------------------------------------------

def split_meta_reference(cu_seqlens_q: np.ndarray, context_lens: np.ndarray,
                         tables: np.ndarray, num_slices: int, slice_blocks: int,
                         tail_blocks: int, block_size: int):
    """(q_lens[N], kv_lens[N], prefix_table[B, S * slice_blocks], tail_table[B, tail_blocks]),
    ``N = B * S + B``: pseudo-sequence ``b * S + j`` is slice ``j`` of sequence ``b`` over keys
    ``[j L, min((j + 1) L, P_b))`` (``L = slice_blocks * block_size``, ``P_b`` the whole blocks
    before its first query row), ``B * S + b`` its tail ``[P_b, context_len)``; an empty slice
    has ``q_len`` 0. Table columns past ``tables``' width are block 0."""
    num_seqs, width = tables.shape
    cols = num_slices * slice_blocks
    q_lens = np.zeros(num_seqs * num_slices + num_seqs, np.int32)
    kv_lens = np.zeros_like(q_lens)
    padded = np.zeros((num_seqs, cols + tail_blocks + width), np.int32)
    padded[:, :width] = tables
    tail = np.zeros((num_seqs, tail_blocks), np.int32)
    slice_len = slice_blocks * block_size
    for b in range(num_seqs):
        q_len = int(cu_seqlens_q[b + 1] - cu_seqlens_q[b])
        context_len = int(context_lens[b])
        prefix_blocks = max(context_len - q_len, 0) // block_size
        prefix_len = prefix_blocks * block_size
        for j in range(num_slices):
            n = b * num_slices + j
            kv_lens[n] = min(max(prefix_len - j * slice_len, 0), slice_len)
            q_lens[n] = q_len if kv_lens[n] else 0
        kv_lens[num_seqs * num_slices + b] = context_len - prefix_len
        q_lens[num_seqs * num_slices + b] = q_len
        tail[b] = padded[b, prefix_blocks:prefix_blocks + tail_blocks]
    return q_lens, kv_lens, padded[:, :cols].copy(), tail


def merge_partials_reference(o_part: np.ndarray, lse: np.ndarray, cu_seqlens_q: np.ndarray,
                             kv_lens: np.ndarray, num_slices: int) -> np.ndarray:
    """Packed ``[T, Hq, D]`` float32: each row the partials of its sequence's non-empty
    pseudo-sequences (``o_part[N, R, Hq, D]``, ``lse[N, Hq, R]``) weighted by ``exp(lse)``."""
    num_seqs = len(cu_seqlens_q) - 1
    _, _, num_heads, head_dim = o_part.shape
    out = np.zeros((int(cu_seqlens_q[-1]), num_heads, head_dim), np.float32)
    for b in range(num_seqs):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        parts = [b * num_slices + j for j in range(num_slices)] + [num_seqs * num_slices + b]
        parts = [n for n in parts if kv_lens[n]]
        rows = end - start
        lses = np.stack([lse[n][:, :rows].T for n in parts])  # [P, rows, Hq]
        weights = np.exp(lses - lses.max(axis=0))
        values = np.stack([o_part[n][:rows].astype(np.float32) for n in parts])
        out[start:end] = (weights[..., None] * values).sum(0) / weights.sum(0)[..., None]
    return out


def split_prefill_reference(q: np.ndarray, kv_cache: np.ndarray, layer: int,
                            tables: np.ndarray, cu_seqlens_q: np.ndarray,
                            context_lens: np.ndarray, scale: float, num_slices: int,
                            slice_blocks: int, max_rows: int) -> np.ndarray:
    """The whole split scheme in NumPy (partials with their log-sum-exp, then the merge);
    equals ``reference.paged_attention_prefill`` for any slicing."""
    block_size = kv_cache.shape[3]
    tail_blocks = tail_width(max_rows, block_size)
    q_lens, kv_lens, prefix, tail = split_meta_reference(
        cu_seqlens_q, context_lens, tables, num_slices, slice_blocks, tail_blocks, block_size)
    num_seqs = len(context_lens)
    num_heads, head_dim = q.shape[1:]
    n_all = num_seqs * num_slices + num_seqs
    o_part = np.zeros((n_all, max_rows, num_heads, head_dim), np.float32)
    lse = np.zeros((n_all, num_heads, max_rows), np.float32)
    for n in range(n_all):
        if not q_lens[n]:
            continue
        is_tail = n >= num_seqs * num_slices
        b = n - num_seqs * num_slices if is_tail else n // num_slices
        table = tail[b] if is_tail else prefix[b, (n % num_slices) * slice_blocks:][:slice_blocks]
        k, v = ref.gather_kv(kv_cache, layer, table, int(kv_lens[n]))
        rows = q[cu_seqlens_q[b]:cu_seqlens_q[b] + q_lens[n]]
        o_part[n, :q_lens[n]], lse[n, :, :q_lens[n]] = _attend_lse(rows, k, v, scale, is_tail)
    return merge_partials_reference(o_part, lse, cu_seqlens_q, kv_lens, num_slices)


def _attend_lse(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool):
    """(out[rows, Hq, D], lse[Hq, rows]) of q over k/v; ``causal``: bottom-right aligned."""
    rows, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = np.repeat(k, group, axis=1).astype(np.float32)
    v = np.repeat(v, group, axis=1).astype(np.float32)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float32), k) * scale
    if causal:
        limit = len(k) - rows + np.arange(rows)
        scores = np.where(np.arange(len(k))[None, None, :] <= limit[None, :, None], scores,
                          -np.inf)
    m = scores.max(-1, keepdims=True)
    p = np.exp(scores - m)
    total = p.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p / total, v)
    return out, (m + np.log(total))[..., 0]


# -- launchers (CuPy: kernels.cuda_module is imported here, the CPU path never loads it) --------

def split_meta(cu_seqlens_q, context_lens, tables, num_slices: int, slice_blocks: int,
               tail_blocks: int, block_size: int, out: tuple):
    """Fill ``out = (q_lens, kv_lens, prefix_table, tail_table)`` as ``split_meta_reference``."""
    from kernels.cuda_module import INT32, check, kernel, num_blocks

    check(cu_seqlens_q, "cu_seqlens_q", INT32, 1)
    check(context_lens, "context_lens", INT32, 1)
    check(tables, "tables", INT32, 2)
    q_lens, kv_lens, prefix, tail = out
    num_seqs, width = tables.shape
    n_all = num_seqs * num_slices + num_seqs
    for name, arr, shape in (("q_lens", q_lens, (n_all,)), ("kv_lens", kv_lens, (n_all,)),
                             ("prefix_table", prefix, (num_seqs, num_slices * slice_blocks)),
                             ("tail_table", tail, (num_seqs, tail_blocks))):
        check(arr, name, INT32)
        if arr.shape != shape:
            raise ValueError(f"{name} has shape {arr.shape}, needs {shape}")
    total = num_seqs * (num_slices * slice_blocks + tail_blocks)
    kernel("split_prefill", "split_meta")(
        (num_blocks(total, _THREADS),), (_THREADS,),
        (cu_seqlens_q, context_lens, tables, np.int32(num_seqs), np.int32(width),
         np.int32(num_slices), np.int32(slice_blocks), np.int32(tail_blocks),
         np.int32(block_size), q_lens, kv_lens, prefix, tail))


def replicate_q(q, cu_seqlens_q, q_lens, q_rep, num_slices: int) -> None:
    """``q_rep[n, i] = q[cu_seqlens_q[b] + i]`` for the rows ``i < q_lens[n]`` of every
    pseudo-sequence ``n`` (of sequence ``b``); ``q_rep[N, R, Hq, D]``."""
    from kernels.cuda_module import BF16, check, kernel, num_blocks

    check(q, "q", BF16, 3)
    check(q_rep, "q_rep", BF16, 4)
    n_all, max_rows, num_heads, head_dim = q_rep.shape
    num_seqs = n_all // (num_slices + 1)
    if q.shape[1:] != (num_heads, head_dim) or (head_dim * num_heads) % 8:
        raise ValueError(f"q {q.shape} does not fit q_rep {q_rep.shape}")
    row_words = num_heads * head_dim // 8
    total = n_all * max_rows * row_words
    kernel("split_prefill", "replicate_q")(
        (num_blocks(total, _THREADS),), (_THREADS,),
        (q, cu_seqlens_q, q_lens, q_rep, np.int32(num_seqs), np.int32(num_slices),
         np.int32(max_rows), np.int32(row_words)))


def merge_partials(o_part, lse, cu_seqlens_q, kv_lens, out, num_slices: int) -> None:
    """``out[T, Hq, D]`` (bf16) as ``merge_partials_reference``."""
    from kernels.cuda_module import BF16, FLOAT32, check, kernel, num_blocks

    check(o_part, "o_part", BF16, 4)
    check(lse, "lse", FLOAT32, 3)
    check(out, "out", BF16, 3)
    n_all, max_rows, num_heads, head_dim = o_part.shape
    if lse.shape != (n_all, num_heads, max_rows) or head_dim % 8:
        raise ValueError(f"lse {lse.shape} does not fit o_part {o_part.shape}")
    num_seqs = n_all // (num_slices + 1)
    head_words = head_dim // 8
    total = num_seqs * max_rows * num_heads * head_words
    kernel("split_prefill", "merge_partials")(
        (num_blocks(total, _THREADS),), (_THREADS,),
        (o_part, lse, cu_seqlens_q, kv_lens, out, np.int32(num_seqs), np.int32(num_slices),
         np.int32(max_rows), np.int32(num_heads), np.int32(head_words)))
