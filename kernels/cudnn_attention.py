"""cuDNN's fused attention (SDPA) over the paged KV arena, driven from CuPy with raw pointers.

The same contracts as ``kernels.reference.paged_attention_prefill`` / ``paged_attention_decode``:
cuDNN reads K and V straight from the block-major arena through its page tables
(``paged_attention_k_table``), the query and output rows are ragged (one offset per sequence into
the packed ``[T, Hq, D]`` rows), per-sequence lengths mask the padding, and the causal mask is
aligned bottom-right, so query row ``i`` of a sequence sits at ``context_len - q_len + i`` (a
cached prefix plus new tokens). No torch: ``nvidia-cudnn-frontend`` builds the graph, the arena
and the step's index arrays are CuPy arrays handed over as device pointers.

A graph depends on the batch's sequence count, its query-row bound and its table width, never on
the layer (the layer is a pointer offset into the arena): one graph serves every layer of a step.
Long prefills (many query rows per sequence) first gather the context's K/V into dense buffers
(``kernels/gather_kv.cu``) and run cuDNN's dense ragged path, faster than its paged path over
16-token pages by far more than the copy costs (KERNELS.md); short queries and decode read the
pages in place. Row bounds and table widths are rounded up to powers of two (the table
padded with block 0, which cuDNN never reads past a sequence's length) so a server builds a few
dozen graphs, not one per prompt length. ``run_*`` return None where cuDNN refuses a shape; the
caller then runs our kernel (``kernels/attention.py``), and ``refusals`` says why. Short queries
over long contexts split the context instead (``kernels/cudnn_split.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.build_log import BuildLog
from kernels.cuda_module import BF16, INT32, check, contiguous
from kernels.cudnn_plans import CudnnPlans, Plan
from kernels.cudnn_split import CudnnSplitPrefill
from kernels.gather_kv import gather_kv
from kernels.plan_builder import PlanBuilder
from kernels.plan_cache import PlanCache
from kernels.write_kv import check_arena

log = logging.getLogger("kernels.cudnn_attention")

_UID_Q, _UID_K, _UID_V, _UID_O = 1, 2, 3, 4
_UID_SEQ_Q, _UID_SEQ_KV, _UID_TABLE_K, _UID_TABLE_V = 5, 6, 7, 8
_UID_OFFSET_Q, _UID_OFFSET_O = 9, 10
_MIN_ROWS = 16  # the smallest query-row bound a prefill graph is built for
# From this many query rows per sequence on, prefill gathers the context into dense buffers:
# the copy pays for itself there, not for short queries (measurements: kernels/KERNELS.md).
_DENSE_ROWS_PER_SEQ = 256
# Short queries over long contexts split the context (kernels/cudnn_split.py): up to this many
# query rows per sequence, from this many context keys (the table's width) on.
_SPLIT_MAX_ROWS = 256
_SPLIT_MIN_KEYS = 2048


class CudnnUnavailable(RuntimeError):
    """cuDNN cannot serve attention in this process (no frontend, no backend library, no GPU)."""


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


@dataclass
class _StepMeta:
    """Per-step index arrays derived once and reused by every layer (the step's arrays are kept
    alive here, so an identity match can never be a recycled allocation)."""

    sources: tuple
    seq_len_q: Any
    offsets_q: Any
    table: Any


class CudnnAttention:
    """One cuDNN handle, a cache of built SDPA graphs, and a growing workspace on the current
    CUDA device. Raises CudnnUnavailable at construction when cuDNN cannot run here."""

    def __init__(self, builds: BuildLog | None = None, plan_cache: PlanCache | None = None,
                 background: PlanBuilder | None = None) -> None:
        try:
            import cudnn
        except Exception as exc:  # ImportError, or a frontend built for another Python/CUDA
            raise CudnnUnavailable(f"nvidia-cudnn-frontend does not import: {exc}") from None
        try:
            self.backend_version = int(cudnn.backend_version())
        except Exception as exc:
            raise CudnnUnavailable(f"no cuDNN backend library (libcudnn.so.9): {exc}") from None
        if self.backend_version < 90500:
            raise CudnnUnavailable(f"cuDNN {self.backend_version} is older than 9.5 (paged SDPA)")
        import cupy as cp

        self.cp = cp
        self.cudnn = cudnn
        self.frontend_version = cudnn.__version__
        try:
            self._handle = cudnn.create_handle()
        except Exception as exc:
            raise CudnnUnavailable(f"cudnnCreate failed: {exc}") from None
        self.plans = CudnnPlans(cudnn, self._handle, builds if builds is not None else BuildLog(),
                                plan_cache if plan_cache is not None else PlanCache(None),
                                background)
        self.refusals = self.plans.refusals  # key -> why cuDNN refused it
        self._workspace = cp.empty(1 << 20, dtype=cp.uint8)
        self._retired_workspaces: list = []  # outgrown, still read by the graphs captured on them
        self._meta: _StepMeta | None = None
        # decode's seq_len_q, default pool: in the graphs' pool other graphs' scratch reuses it
        self._ones = cp.ones(1 << 16, dtype=cp.int32)
        self.gather = True  # dense prefill where it pays (_DENSE_ROWS_PER_SEQ); False: paged
        # one long sequence at its exact sizes (``_run_exact``): off, as cuDNN 9.19 refused the
        # override shapes on an H100 (KERNELS.md); a refusal falls back to the padded path
        self.exact = False
        self.calls: dict[tuple, int] = {}  # calls per path: ("exact",), (causal, dense)
        # short queries over long contexts: split over the context (False: one paged call)
        self.split: CudnnSplitPrefill | None = CudnnSplitPrefill(self)

    def close(self) -> None:
        """Stops the background builder, if one runs."""
        if self.plans.background is not None:
            self.plans.background.close()

    @property
    def num_graphs(self) -> int:
        """Graphs built or loaded (refused shapes not counted)."""
        return self.plans.num_graphs

    @property
    def version(self) -> str:
        v = self.backend_version
        return f"frontend {self.frontend_version}, backend {v // 10000}.{v // 100 % 100}.{v % 100}"

    # -- graphs ------------------------------------------------------------------------------

    def plan(self, key: tuple) -> Plan | None:
        """The built graph of ``key``, or None where cuDNN refuses it (remembered, with the
        reason) or, after the seal, while the background builder builds it."""
        return self.plans.get(key, lambda: self.build(key))

    def build(self, key: tuple) -> Plan:
        """Builds ``key``'s graph: a key says everything its graph depends on, so a builder
        process builds from the key alone."""
        if key[0] == "exact":
            return self._build_exact(*key[1:])
        if key[0] == "split":
            return self.split.build(*key[1:])
        return self._build(*key)

    def new_graph(self):
        """An empty bf16-in, float32-inside cuDNN graph on this handle."""
        dt = self.cudnn.data_type
        return self.cudnn.pygraph(io_data_type=dt.BFLOAT16, intermediate_data_type=dt.FLOAT,
                                  compute_data_type=dt.FLOAT, handle=self._handle)

    def _build(self, causal: bool, dense: bool, num_seqs: int, max_rows: int,
               table_width: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, block_stride: tuple[int, int], scale: float) -> Plan:
        """``max_rows`` query rows at most per sequence; ragged (packed rows) when ``causal``
        (prefill), one row per sequence otherwise (decode). K/V are read through the page
        tables from the arena, or (``dense``) from ``[B, table_width * block_size, Hkv, D]``
        buffers that ``gather_kv`` filled."""
        cudnn = self.cudnn
        dt = cudnn.data_type
        g = self.new_graph()
        row_stride = num_q_heads * head_dim  # packed [T, Hq, D] rows
        qo_dim = [num_seqs, num_q_heads, max_rows, head_dim]
        qo_stride = [max_rows * row_stride, head_dim, row_stride, 1]
        offsets_q = offsets_o = None
        if causal:
            offsets_q = g.tensor(name="offsets_q", dim=[num_seqs + 1, 1, 1, 1],
                                 stride=[1, 1, 1, 1], data_type=dt.INT32, uid=_UID_OFFSET_Q)
            offsets_o = g.tensor(name="offsets_o", dim=[num_seqs + 1, 1, 1, 1],
                                 stride=[1, 1, 1, 1], data_type=dt.INT32, uid=_UID_OFFSET_O)
        q = g.tensor(name="q", dim=qo_dim, stride=qo_stride, data_type=dt.BFLOAT16, uid=_UID_Q,
                     ragged_offset=offsets_q)
        max_keys = table_width * block_size
        if dense:  # [B, max_keys, Hkv, D] buffers
            kv_dim = [num_seqs, num_kv_heads, max_keys, head_dim]
            kv_stride = [max_keys * num_kv_heads * head_dim, head_dim, num_kv_heads * head_dim, 1]
        else:  # K and V of one layer: [num_blocks, Hkv, block_size, D] views of the arena
            kv_dim = [block_stride[0], num_kv_heads, block_size, head_dim]
            kv_stride = [block_stride[1], head_dim, num_kv_heads * head_dim, 1]
        k = g.tensor(name="k", dim=kv_dim, stride=kv_stride, data_type=dt.BFLOAT16, uid=_UID_K)
        v = g.tensor(name="v", dim=kv_dim, stride=kv_stride, data_type=dt.BFLOAT16, uid=_UID_V)
        lens = dict(dim=[num_seqs, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        seq_q = g.tensor(name="seq_len_q", uid=_UID_SEQ_Q, **lens)
        seq_kv = g.tensor(name="seq_len_kv", uid=_UID_SEQ_KV, **lens)
        paged = {}
        if not dense:
            table = dict(dim=[num_seqs, 1, table_width, 1],
                         stride=[table_width, table_width, 1, 1], data_type=dt.INT32)
            paged = dict(paged_attention_k_table=g.tensor(name="table_k", uid=_UID_TABLE_K,
                                                          **table),
                         paged_attention_v_table=g.tensor(name="table_v", uid=_UID_TABLE_V,
                                                          **table),
                         paged_attention_max_seq_len_kv=max_keys)
        o, _ = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=scale, generate_stats=False,
                      use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
                      use_causal_mask_bottom_right=causal, compute_data_type=dt.FLOAT, **paged)
        o.set_output(True).set_dim(qo_dim).set_stride(qo_stride).set_data_type(dt.BFLOAT16)
        o.set_uid(_UID_O)
        if causal:
            o.set_ragged_offset(offsets_o)
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        return Plan.of(g)

    def _build_exact(self, max_rows: int, max_keys: int, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, scale: float) -> Plan:
        """One sequence, dense K/V, built at its bounds and run at its exact sizes (override
        shapes, cuDNN >= 9.18): no padding mask, whose per-row length checks cost ~6% at 16k."""
        cudnn = self.cudnn
        dt = cudnn.data_type
        g = cudnn.pygraph(io_data_type=dt.BFLOAT16, intermediate_data_type=dt.FLOAT,
                          compute_data_type=dt.FLOAT, handle=self._handle,
                          is_override_shape_enabled=True)
        qo_dim, qo_stride = _dense_layout(max_rows, num_q_heads, head_dim, max_rows)
        kv_dim, kv_stride = _dense_layout(max_keys, num_kv_heads, head_dim, max_keys)
        q = g.tensor(name="q", dim=qo_dim, stride=qo_stride, data_type=dt.BFLOAT16, uid=_UID_Q)
        k = g.tensor(name="k", dim=kv_dim, stride=kv_stride, data_type=dt.BFLOAT16, uid=_UID_K)
        v = g.tensor(name="v", dim=kv_dim, stride=kv_stride, data_type=dt.BFLOAT16, uid=_UID_V)
        o, _ = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=scale, generate_stats=False,
                      use_causal_mask_bottom_right=True, compute_data_type=dt.FLOAT)
        o.set_output(True).set_dim(qo_dim).set_stride(qo_stride).set_data_type(dt.BFLOAT16)
        o.set_uid(_UID_O)
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        return Plan.of(g)

    def execute(self, plan: Plan, pointers: dict[int, int], **overrides) -> None:
        """Run ``plan`` on the current stream with ``pointers`` (uid -> device address)."""
        cp = self.cp
        if plan.workspace_bytes > self._workspace.nbytes:
            # a captured graph keeps the old one's address: it stays allocated (each one at
            # least twice the last, so a few)
            self._retired_workspaces.append(self._workspace)
            self._workspace = cp.empty(max(plan.workspace_bytes, 2 * self._workspace.nbytes),
                                       dtype=cp.uint8)
        self.cudnn.set_stream(self._handle, cp.cuda.get_current_stream().ptr)
        plan.graph.execute(pointers, workspace=self._workspace.data.ptr, handle=self._handle,
                           **overrides)

    @staticmethod
    def layer_pointers(kv_cache, layer: int) -> tuple[int, int, tuple[int, int]]:
        """(K pointer, V pointer, (num_blocks, block stride in elements)) of ``layer``."""
        num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        plane = block_size * num_kv_heads * head_dim
        k_ptr = kv_cache.data.ptr + 2 * layer * plane * kv_cache.itemsize
        return k_ptr, k_ptr + plane * kv_cache.itemsize, (num_blocks, num_layers * 2 * plane)

    # -- per-step metadata ---------------------------------------------------------------

    def _step_meta(self, layer: int, cu_seqlens_q, block_tables, row_elems: int,
                   table_width: int):
        """Derived once per step, at layer 0 (a graph capture re-runs a step on the same
        arrays: the capture must record the derivation, not reuse the warm-up's result)."""
        meta = self._meta
        if layer != 0 and meta is not None and meta.sources[0] is cu_seqlens_q and \
                meta.sources[1] is block_tables and meta.table.shape[1] == table_width:
            return meta
        cp = self.cp
        seq_len_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        offsets_q = cu_seqlens_q * np.int32(row_elems)
        table = block_tables
        if block_tables.shape[1] != table_width:
            table = cp.zeros((block_tables.shape[0], table_width), dtype=cp.int32)
            table[:, :block_tables.shape[1]] = block_tables
        self._meta = _StepMeta((cu_seqlens_q, block_tables), seq_len_q, offsets_q, table)
        return self._meta

    # -- the two attention calls -------------------------------------------------------------

    def run_prefill(self, q, kv_cache, layer: int, block_tables, cu_seqlens_q, context_lens,
                    scale: float, max_query_len: int | None = None,
                    max_context_len: int | None = None):
        """``[T, Hq, D]`` like ``paged_attention_prefill``, or None where cuDNN refuses.
        ``max_query_len`` / ``max_context_len``: the host's bounds, when it knows them; a single
        long sequence with both known runs at its exact sizes (``_build_exact``)."""
        q, block_tables = contiguous(q), contiguous(block_tables)
        cu_seqlens_q, context_lens = contiguous(cu_seqlens_q), contiguous(context_lens)
        shape = _check(q, kv_cache, layer, block_tables, context_lens)
        check(cu_seqlens_q, "cu_seqlens_q", INT32, 1)
        num_tokens, num_q_heads, head_dim = q.shape
        num_seqs = context_lens.shape[0]
        if cu_seqlens_q.shape[0] != num_seqs + 1:
            raise ValueError(f"cu_seqlens_q needs {num_seqs + 1} entries, has "
                             f"{cu_seqlens_q.shape[0]}")
        if num_tokens == 0 or num_seqs == 0:
            return self.cp.empty_like(q)
        rows = num_tokens if max_query_len is None else min(num_tokens, max_query_len)
        max_rows = _pow2(rows, _MIN_ROWS)
        width = _pow2(block_tables.shape[1])
        meta = self._step_meta(layer, cu_seqlens_q, block_tables, num_q_heads * head_dim,
                               width)
        if self.split is not None and max_rows <= _SPLIT_MAX_ROWS and \
                width * shape[3] >= _SPLIT_MIN_KEYS:
            out = self.split.run(q, kv_cache, layer, meta.table, cu_seqlens_q, context_lens,
                                 scale, max_rows)
            if out is not None:
                self.calls[("split",)] = self.calls.get(("split",), 0) + 1
                return out
        out = self.cp.empty_like(q)
        dense = self.gather and num_tokens >= _DENSE_ROWS_PER_SEQ * num_seqs
        k_ptr, v_ptr, block_stride = self.layer_pointers(kv_cache, layer)
        key = (True, dense, num_seqs, max_rows, width, num_q_heads, shape[4], head_dim,
               shape[3], block_stride, float(scale))
        if dense:
            k, v = gather_kv(kv_cache, layer, meta.table, context_lens)
            k_ptr, v_ptr = k.data.ptr, v.data.ptr
            if num_seqs == 1 and max_query_len == num_tokens and max_context_len and \
                    self._run_exact(q, k, v, out, max_rows, max_context_len, scale):
                return out
        plan = self.plan(key)
        if plan is None:
            return None
        self.calls[key[:2]] = self.calls.get(key[:2], 0) + 1
        self.execute(plan, {
            _UID_Q: q.data.ptr, _UID_K: k_ptr, _UID_V: v_ptr, _UID_O: out.data.ptr,
            _UID_SEQ_Q: meta.seq_len_q.data.ptr, _UID_SEQ_KV: context_lens.data.ptr,
            _UID_TABLE_K: meta.table.data.ptr, _UID_TABLE_V: meta.table.data.ptr,
            _UID_OFFSET_Q: meta.offsets_q.data.ptr, _UID_OFFSET_O: meta.offsets_q.data.ptr})
        return out

    def _run_exact(self, q, k, v, out, max_rows: int, context_len: int, scale: float) -> bool:
        """One sequence at its exact sizes; False where cuDNN refuses (the caller goes on)."""
        num_tokens, num_q_heads, head_dim = q.shape
        max_keys, num_kv_heads = k.shape[1], k.shape[2]
        if not self.exact or context_len > max_keys or context_len < num_tokens:
            return False
        key = ("exact", max_rows, max_keys, num_q_heads, num_kv_heads, head_dim, float(scale))
        plan = self.plan(key)
        if plan is None:
            return False
        qo = _dense_layout(num_tokens, num_q_heads, head_dim, num_tokens)
        kv = _dense_layout(context_len, num_kv_heads, head_dim, max_keys)
        try:
            self.execute(plan, {_UID_Q: q.data.ptr, _UID_K: k.data.ptr, _UID_V: v.data.ptr,
                                 _UID_O: out.data.ptr},
                          override_uids=[_UID_Q, _UID_K, _UID_V, _UID_O],
                          override_shapes=[qo[0], kv[0], kv[0], qo[0]],
                          override_strides=[qo[1], kv[1], kv[1], qo[1]])
        except Exception as exc:  # the backend refuses the override: never try this key again
            self.plans.refuse(key, f"{type(exc).__name__}: {exc}")
            log.warning("cuDNN SDPA refuses overriding %s: %s", key, exc)
            return False
        self.calls[key[:1]] = self.calls.get(key[:1], 0) + 1
        return True

    def run_decode(self, q, kv_cache, layer: int, block_tables, context_lens, scale: float):
        """``[B, Hq, D]`` like ``paged_attention_decode``, or None where cuDNN refuses. The
        table width is used as is (decode graphs fix it per bucket)."""
        q, block_tables = contiguous(q), contiguous(block_tables)
        context_lens = contiguous(context_lens)
        shape = _check(q, kv_cache, layer, block_tables, context_lens)
        num_seqs, num_q_heads, head_dim = q.shape
        if context_lens.shape[0] != num_seqs:
            raise ValueError(f"q has {num_seqs} rows for {context_lens.shape[0]} sequences")
        out = self.cp.empty_like(q)
        if num_seqs == 0:
            return out
        if num_seqs > self._ones.shape[0]:
            return None
        width = block_tables.shape[1]
        k_ptr, v_ptr, block_stride = self.layer_pointers(kv_cache, layer)
        key = (False, False, num_seqs, 1, width, num_q_heads, shape[4], head_dim, shape[3],
               block_stride, float(scale))
        plan = self.plan(key)
        if plan is None:
            return None
        self.calls[key[:2]] = self.calls.get(key[:2], 0) + 1
        self.execute(plan, {
            _UID_Q: q.data.ptr, _UID_K: k_ptr, _UID_V: v_ptr, _UID_O: out.data.ptr,
            _UID_SEQ_Q: self._ones.data.ptr, _UID_SEQ_KV: context_lens.data.ptr,
            _UID_TABLE_K: block_tables.data.ptr, _UID_TABLE_V: block_tables.data.ptr})
        return out


def _dense_layout(num_rows: int, num_heads: int, head_dim: int, rows_per_seq: int
                  ) -> tuple[list[int], list[int]]:
    """(dims, strides) of one sequence's ``[rows, heads, D]`` rows as cuDNN's [B, H, S, D]."""
    return ([1, num_heads, num_rows, head_dim],
            [rows_per_seq * num_heads * head_dim, head_dim, num_heads * head_dim, 1])


def _check(q, kv_cache, layer: int, block_tables, context_lens):
    shape = check_arena(kv_cache, layer)
    check(q, "q", BF16, 3)
    check(block_tables, "block_tables", INT32, 2)
    check(context_lens, "context_lens", INT32, 1)
    if kv_cache.dtype != BF16:
        raise TypeError(f"cuDNN attention reads a bfloat16 arena, got {kv_cache.dtype}")
    if q.shape[2] != shape[5] or q.shape[1] % shape[4]:
        raise ValueError(f"q {q.shape} does not fit the arena's heads {shape[4:]}")
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables {block_tables.shape} and context_lens "
                         f"{context_lens.shape} disagree on the sequence count")
    return shape
