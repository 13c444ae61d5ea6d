"""The split prefill scheme (kernels/split_prefill.py) on CPU: slicing the context, the tail and
the log-sum-exp merge together equal the plain causal paged reference, for any slicing."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import reference as ref
from kernels.split_prefill import split_meta_reference, split_prefill_reference

CASES = [
    # block_size, context_lens, q_lens, num_slices, slice_blocks, max_rows
    (16, [1000], [40], 4, 16, 64),               # a turn over a cached prefix
    (16, [1000], [40], 32, 2, 64),               # more slices than the prefix needs
    (16, [300, 70, 17, 200], [3, 1, 17, 77], 4, 8, 128),  # ragged, a decode row, a cold prompt
    (8, [129, 64], [65, 64], 3, 6, 128),        # other block size, slices not a power of two
]


@pytest.mark.parametrize("case", CASES)
def test_split_prefill_reference_equals_the_paged_reference(case) -> None:
    block_size, lens, q_lens, num_slices, slice_blocks, max_rows = case
    rng = np.random.default_rng(3)
    num_kv_heads, num_q_heads, head_dim = 2, 8, 16
    blocks = [-(-n // block_size) for n in lens]
    kv = rng.standard_normal((sum(blocks) + 3, 2, 2, block_size, num_kv_heads, head_dim))
    kv = kv.astype(np.float32)
    perm = rng.permutation(kv.shape[0]).astype(np.int32)
    tables = np.zeros((len(lens), num_slices * slice_blocks), np.int32)
    start = 0
    for b, n in enumerate(blocks):
        assert n <= tables.shape[1]
        tables[b, :n] = perm[start:start + n]
        start += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), num_q_heads, head_dim)).astype(np.float32)
    ctx = np.array(lens, np.int32)
    want = ref.paged_attention_prefill(q, kv, 1, tables, cu, ctx, 0.25)
    got = split_prefill_reference(q, kv, 1, tables, cu, ctx, 0.25, num_slices, slice_blocks,
                                  max_rows)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_split_meta_reference_covers_every_key_once() -> None:
    """Slices hold the whole blocks before the first query row; the tail starts there."""
    cu = np.array([0, 40, 41], np.int32)
    ctx = np.array([1000, 33], np.int32)
    tables = np.arange(2 * 64, dtype=np.int32).reshape(2, 64)
    q_lens, kv_lens, prefix, tail = split_meta_reference(cu, ctx, tables, 4, 16, 4, 16)
    # 1000 - 40 = 960 = 60 whole blocks: slices of 256 keys, 256, 256, 192; tail 40 keys
    # 33 - 1 = 32: one slice of 32 keys, three empty ones (no query rows), a tail of 1 key
    assert kv_lens.tolist() == [256, 256, 256, 192, 32, 0, 0, 0, 40, 1]
    assert q_lens.tolist() == [40, 40, 40, 40, 1, 0, 0, 0, 40, 1]
    assert tail[0].tolist() == [60, 61, 62, 63]
    assert tail[1].tolist() == [66, 67, 68, 69]
    assert prefix[1, :3].tolist() == [64, 65, 66]


def _case(rng, block_size, lens, q_lens, width, num_kv_heads=2, num_q_heads=8, head_dim=16):
    """A paged arena with each sequence's blocks scattered, tables ``width`` wide, q rows."""
    blocks = [-(-n // block_size) for n in lens]
    kv = rng.standard_normal((sum(blocks) + 3, 2, 2, block_size, num_kv_heads, head_dim))
    kv = kv.astype(np.float32)
    perm = 1 + rng.permutation(kv.shape[0] - 1).astype(np.int32)  # block 0: table padding
    tables = np.zeros((len(lens), width), np.int32)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[start:start + n]
        start += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), num_q_heads, head_dim)).astype(np.float32)
    return kv, tables, cu, q, np.array(lens, np.int32)


EDGE_CASES = [
    # block_size, context_lens, q_lens, width, num_slices, slice_blocks, max_rows
    (16, [16 * 64 + 16], [16], 65, 4, 16, 16),    # the prefix fills every slice exactly
    (16, [32, 48], [1, 1], 8, 4, 2, 16),          # one row at a block boundary: tail = a block
    (16, [5], [5], 128, 8, 16, 16),               # a context under one block in a wide table
    (16, [16], [16], 128, 8, 16, 16),             # a cold prompt of exactly one block
    (16, [4000, 17, 300, 2], [255, 17, 1, 2], 256, 8, 32, 256),  # the largest rows, ragged
]


@pytest.mark.parametrize("case", EDGE_CASES)
def test_split_prefill_reference_edge_cases(case) -> None:
    block_size, lens, q_lens, width, num_slices, slice_blocks, max_rows = case
    kv, tables, cu, q, ctx = _case(np.random.default_rng(11), block_size, lens, q_lens, width)
    want = ref.paged_attention_prefill(q, kv, 0, tables, cu, ctx, 0.25)
    got = split_prefill_reference(q, kv, 0, tables, cu, ctx, 0.25, num_slices, slice_blocks,
                                  max_rows)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_split_merge_is_stable_for_large_scores() -> None:
    """Scores in the thousands: exp(lse) overflows float32, the max-subtracted merge does not."""
    kv, tables, cu, q, ctx = _case(np.random.default_rng(12), 16, [700, 90], [40, 9], 64)
    q *= 300.0
    want = ref.paged_attention_prefill(q, kv, 0, tables, cu, ctx, 1.0)
    got = split_prefill_reference(q, kv, 0, tables, cu, ctx, 1.0, 8, 8, 64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)  # scores ~1e3: float32 ulps


def test_split_prefill_padding_rows_leave_the_real_rows_alone() -> None:
    """A graph bucket's layout (engine/step_inputs.pack_prefill): padding rows join the last
    sequence and extend its context over stale keys; its real rows keep their outputs."""
    block_size, lens, q_lens = 16, [1000, 530], [40, 7]
    kv, tables, cu, q, ctx = _case(np.random.default_rng(13), block_size, lens, q_lens, 80)
    want = ref.paged_attention_prefill(q, kv, 0, tables, cu, ctx, 0.25)
    pad = 64 - int(cu[-1])
    padded_q = np.concatenate([q, np.full((pad, *q.shape[1:]), 7.0, np.float32)])
    padded_cu, padded_ctx = cu.copy(), ctx.copy()
    padded_cu[-1] += pad
    padded_ctx[-1] += pad
    kv[0] = 1e3  # block 0 (the table's padding) holds huge stale keys
    got = split_prefill_reference(padded_q, kv, 0, tables, padded_cu, padded_ctx, 0.25, 8, 16,
                                  64)
    np.testing.assert_allclose(got[: int(cu[-1])], want, rtol=1e-4, atol=1e-5)
