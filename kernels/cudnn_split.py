"""cuDNN SDPA split over the context for short prefill queries (flash-decoding for prefill).

A chat turn's last few dozen tokens over a 16k cached prefix give cuDNN's paged prefill only
(query heads x query tiles) = 32 CTAs per layer on an H100's 132 SMs, each walking all 16k keys.
Here each sequence's context becomes ``num_slices`` pseudo-sequences of one batched cuDNN call
(the whole blocks before the first query row, unmasked, each with its log-sum-exp) plus one
causal bottom-right call over the rest (the tail: the new tokens and the partial block before
them), merged by ``merge_partials``. The pseudo-sequences' page tables are slices of the
sequence's own table, so nothing is copied but the query rows. Every size depends on the batch
shape only (sequences, query-row bound, table width), never on the lengths, so a step replays
from a CUDA graph. Kernels and references: ``kernels/split_prefill.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels.cudnn_plans import Plan
from kernels.split_prefill import merge_partials, replicate_q, split_meta, tail_width

# Slices per sequence: the table's keys / SLICE_KEYS, within [MIN_SLICES, MAX_SLICES]; fewer,
# longer slices win once a few fill the GPU (measured per slice count: kernels/KERNELS.md).
SLICE_KEYS = 4096
MIN_SLICES, MAX_SLICES = 8, 64
# Scratch bound of one split step (q_rep, o_part, lse): every sequence of the step, decode rows
# included, costs (slices + 1) x the step's query-row bound rows; past this bound the step runs
# as one paged call (its sequences' own tiles fill the GPU by then). Sizes: kernels/KERNELS.md.
MAX_SCRATCH_BYTES = 512 << 20
_UID_Q, _UID_K, _UID_V, _UID_O, _UID_STATS = 1, 2, 3, 4, 11
_UID_SEQ_Q, _UID_SEQ_KV, _UID_TABLE_K, _UID_TABLE_V = 5, 6, 7, 8


def slice_count(table_width: int, block_size: int) -> int:
    """Slices per sequence for a table ``table_width`` blocks wide (before the width cap)."""
    return min(MAX_SLICES, max(MIN_SLICES, table_width * block_size // SLICE_KEYS))


def scratch_bytes(num_seqs: int, num_slices: int, max_rows: int, num_q_heads: int,
                  head_dim: int) -> int:
    """Device bytes of one split step's q_rep and o_part (bf16) and lse (float32)."""
    return num_seqs * (num_slices + 1) * max_rows * num_q_heads * (4 * head_dim + 4)


@dataclass
class _Step:
    """One step's index arrays and scratch buffers, shared by all its layers."""

    sources: tuple
    config: tuple
    q_lens: Any
    kv_lens: Any
    prefix_table: Any
    tail_table: Any
    q_rep: Any
    o_part: Any
    lse: Any


class CudnnSplitPrefill:
    """Runs ``paged_attention_prefill`` as slices + tail + merge on a ``CudnnAttention``'s
    handle, plan cache and workspace (composition: that object owns them)."""

    def __init__(self, attention) -> None:
        self._attn = attention
        self._cp = attention.cp
        self._step: _Step | None = None
        self.num_slices: int | None = None  # per sequence; None: from the table's width

    def run(self, q, kv_cache, layer: int, block_tables, cu_seqlens_q, context_lens,
            scale: float, max_rows: int):
        """``[T, Hq, D]`` like ``paged_attention_prefill`` (at most ``max_rows`` query rows per
        sequence; ``block_tables`` as wide as every context), or None where cuDNN refuses or
        the step's scratch would pass ``MAX_SCRATCH_BYTES``."""
        cp = self._cp
        num_tokens, num_q_heads, head_dim = q.shape
        _, _, _, block_size, num_kv_heads, _ = kv_cache.shape
        num_seqs, width = block_tables.shape
        num_slices = min(self.num_slices or slice_count(width, block_size), width)
        if scratch_bytes(num_seqs, num_slices, max_rows, num_q_heads, head_dim) > \
                MAX_SCRATCH_BYTES:
            return None  # the caller runs one paged call
        slice_blocks = -(-width // num_slices)
        tail_blocks = tail_width(max_rows, block_size)
        k_ptr, v_ptr, block_stride = self._attn.layer_pointers(kv_cache, layer)
        common = (max_rows, num_q_heads, num_kv_heads, head_dim, block_size, block_stride,
                  float(scale))
        prefix_plan = self._attn.plan(("split", False, num_seqs * num_slices, slice_blocks)
                                      + common)
        tail_plan = self._attn.plan(("split", True, num_seqs, tail_blocks) + common)
        if prefix_plan is None or tail_plan is None:
            return None
        step = self._step_for(layer, q, block_tables, cu_seqlens_q, context_lens,
                              (num_slices, slice_blocks, tail_blocks, max_rows, block_size))
        replicate_q(q, cu_seqlens_q, step.q_lens, step.q_rep, num_slices)
        n_prefix = num_seqs * num_slices
        row_bytes = max_rows * num_q_heads * head_dim * q.itemsize
        lse_bytes = num_q_heads * max_rows * 4
        for plan, n0, table in ((prefix_plan, 0, step.prefix_table),
                                (tail_plan, n_prefix, step.tail_table)):
            self._attn.execute(plan, {
                _UID_Q: step.q_rep.data.ptr + n0 * row_bytes, _UID_K: k_ptr, _UID_V: v_ptr,
                _UID_O: step.o_part.data.ptr + n0 * row_bytes,
                _UID_STATS: step.lse.data.ptr + n0 * lse_bytes,
                _UID_SEQ_Q: step.q_lens.data.ptr + n0 * 4,
                _UID_SEQ_KV: step.kv_lens.data.ptr + n0 * 4,
                _UID_TABLE_K: table.data.ptr, _UID_TABLE_V: table.data.ptr})
        out = cp.empty_like(q)
        if num_tokens:
            merge_partials(step.o_part, step.lse, cu_seqlens_q, step.kv_lens, out, num_slices)
        return out

    def _step_for(self, layer: int, q, block_tables, cu_seqlens_q, context_lens, config):
        """The step's arrays: derived at layer 0 (or on new inputs), reused by later layers.
        Recomputing at layer 0 matters for CUDA graphs: a capture re-runs a step on the same
        input arrays, and the graph must record this derivation, not read a stale one."""
        step = self._step
        sources = (cu_seqlens_q, context_lens, block_tables)
        if layer != 0 and step is not None and step.config == config and \
                all(a is b for a, b in zip(step.sources, sources)):
            return step
        cp = self._cp
        num_slices, slice_blocks, tail_blocks, max_rows, block_size = config
        num_seqs = block_tables.shape[0]
        n_all = num_seqs * num_slices + num_seqs
        _, num_q_heads, head_dim = q.shape
        step = _Step(sources, config,
                     q_lens=cp.empty(n_all, cp.int32), kv_lens=cp.empty(n_all, cp.int32),
                     prefix_table=cp.empty((num_seqs, num_slices * slice_blocks), cp.int32),
                     tail_table=cp.empty((num_seqs, tail_blocks), cp.int32),
                     q_rep=cp.empty((n_all, max_rows, num_q_heads, head_dim), q.dtype),
                     o_part=cp.empty((n_all, max_rows, num_q_heads, head_dim), q.dtype),
                     lse=cp.empty((n_all, num_q_heads, max_rows), cp.float32))
        split_meta(cu_seqlens_q, context_lens, block_tables, num_slices, slice_blocks,
                   tail_blocks, block_size,
                   (step.q_lens, step.kv_lens, step.prefix_table, step.tail_table))
        self._step = step
        return step

    def build(self, causal: bool, num_seqs: int, table_width: int, max_rows: int,
               num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               block_stride: tuple[int, int], scale: float):
        """Paged K/V through ``[num_seqs, table_width]`` tables, padded (not ragged) query and
        output rows ``[num_seqs, max_rows, Hq, D]``, the log-sum-exp out as ``[num_seqs, Hq,
        max_rows]`` float32; ``causal``: bottom-right aligned, else unmasked."""
        cudnn = self._attn.cudnn
        dt = cudnn.data_type
        g = self._attn.new_graph()
        row = num_q_heads * head_dim
        qo_dim = [num_seqs, num_q_heads, max_rows, head_dim]
        qo_stride = [max_rows * row, head_dim, row, 1]
        q = g.tensor(name="q", dim=qo_dim, stride=qo_stride, data_type=dt.BFLOAT16, uid=_UID_Q)
        kv_dim = [block_stride[0], num_kv_heads, block_size, head_dim]
        kv_stride = [block_stride[1], head_dim, num_kv_heads * head_dim, 1]
        k = g.tensor(name="k", dim=kv_dim, stride=kv_stride, data_type=dt.BFLOAT16, uid=_UID_K)
        v = g.tensor(name="v", dim=kv_dim, stride=kv_stride, data_type=dt.BFLOAT16, uid=_UID_V)
        lens = dict(dim=[num_seqs, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        seq_q = g.tensor(name="seq_len_q", uid=_UID_SEQ_Q, **lens)
        seq_kv = g.tensor(name="seq_len_kv", uid=_UID_SEQ_KV, **lens)
        table = dict(dim=[num_seqs, 1, table_width, 1],
                     stride=[table_width, table_width, 1, 1], data_type=dt.INT32)
        o, stats = g.sdpa(
            name="sdpa", q=q, k=k, v=v, attn_scale=scale, generate_stats=True,
            use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
            use_causal_mask_bottom_right=causal, compute_data_type=dt.FLOAT,
            paged_attention_k_table=g.tensor(name="table_k", uid=_UID_TABLE_K, **table),
            paged_attention_v_table=g.tensor(name="table_v", uid=_UID_TABLE_V, **table),
            paged_attention_max_seq_len_kv=table_width * block_size)
        o.set_output(True).set_dim(qo_dim).set_stride(qo_stride).set_data_type(dt.BFLOAT16)
        o.set_uid(_UID_O)
        stats.set_output(True).set_data_type(dt.FLOAT).set_uid(_UID_STATS)
        stats.set_dim([num_seqs, num_q_heads, max_rows, 1])
        stats.set_stride([num_q_heads * max_rows, max_rows, 1, 1])
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        return Plan.of(g)
