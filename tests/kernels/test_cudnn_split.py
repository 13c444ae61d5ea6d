"""The split prefill (kernels/cudnn_split.py, kernels/split_prefill.cu) on a GPU: the index
kernel bit-exact and the merge against their NumPy references, and short queries over long
paged contexts through ``CudnnAttention.run_prefill`` against the causal reference, split on
and off. Skipped without a GPU (and the cuDNN part without cuDNN)."""

from __future__ import annotations

import numpy as np
import pytest
from test_cudnn_attention import paged_case, rel_err

from kernels import reference as ref
from kernels import split_prefill as sp

pytestmark = pytest.mark.gpu


def test_split_meta_kernel_is_bit_exact(cp) -> None:
    cu = np.array([0, 40, 41, 297], np.int32)
    ctx = np.array([16000, 33, 3000], np.int32)
    rng = np.random.default_rng(1)
    tables = rng.integers(1, 5000, (3, 1024)).astype(np.int32)
    num_slices, slice_blocks, tail_blocks = 32, 32, sp.tail_width(256, 16)
    want = sp.split_meta_reference(cu, ctx, tables, num_slices, slice_blocks, tail_blocks, 16)
    got = tuple(cp.zeros_like(cp.asarray(w)) for w in want)
    sp.split_meta(cp.asarray(cu), cp.asarray(ctx), cp.asarray(tables), num_slices,
                  slice_blocks, tail_blocks, 16, got)
    for name, g, w in zip(("q_lens", "kv_lens", "prefix", "tail"), got, want):
        np.testing.assert_array_equal(cp.asnumpy(g), w, err_msg=name)


def test_merge_kernel_matches_reference(cp, bf16) -> None:
    rng = np.random.default_rng(2)
    num_slices, max_rows, num_heads, head_dim = 3, 16, 4, 64
    cu = np.array([0, 5, 21], np.int32)
    n_all = 2 * num_slices + 2
    o_part = rng.standard_normal((n_all, max_rows, num_heads, head_dim)).astype(bf16)
    lse = (rng.standard_normal((n_all, num_heads, max_rows)) * 4).astype(np.float32)
    kv_lens = np.array([64, 0, 64, 64, 64, 30, 7, 9], np.int32)  # an empty slice is skipped
    out = cp.empty((21, num_heads, head_dim), dtype=bf16)
    sp.merge_partials(cp.asarray(o_part), cp.asarray(lse), cp.asarray(cu), cp.asarray(kv_lens),
                      out, num_slices)
    want = sp.merge_partials_reference(o_part.astype(np.float32), lse, cu, kv_lens, num_slices)
    assert rel_err(cp.asnumpy(out), want) < 5e-3


SPLIT_CASES = [
    # block_size, context_lens, q_lens, Hq, Hkv, D
    (16, [16384], [40], 32, 8, 128),                  # the turn: 40 tokens over 16k
    (16, [5000, 3001, 2500], [200, 1, 77], 32, 8, 128),  # ragged, a decode row, tails
    (16, [4096], [256], 32, 8, 128),                  # the largest split query
    (32, [2500, 60], [17, 60], 16, 2, 64),           # other heads, block size, a cold prompt
]


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_prefill_matches_reference(cp, bf16, case) -> None:
    from kernels.cudnn_attention import CudnnAttention, CudnnUnavailable

    try:
        attn = CudnnAttention()
    except CudnnUnavailable as exc:
        pytest.skip(f"cuDNN is not available here: {exc}")
    block_size, lens, q_lens, num_q_heads, num_kv_heads, head_dim = case
    rng = np.random.default_rng(21)
    kv, tables = paged_case(rng, bf16, block_size, lens, num_kv_heads, head_dim, spare_width=3)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), num_q_heads, head_dim)).astype(bf16)
    ctx = np.array(lens, dtype=np.int32)
    scale = head_dim ** -0.5
    args = (cp.asarray(q), cp.asarray(kv), 1, cp.asarray(tables), cp.asarray(cu),
            cp.asarray(ctx), scale, max(q_lens))
    got = attn.run_prefill(*args)
    assert got is not None, f"cuDNN refused: {attn.refusals}"
    assert attn.calls.get(("split",)) == 1, f"the split did not serve it: {attn.refusals}"
    want = ref.paged_attention_prefill(q.astype(np.float32), kv.astype(np.float32), 1, tables,
                                       cu, ctx, scale)
    assert rel_err(cp.asnumpy(got), want) < 1e-2
    split = attn.split
    attn.split = None  # one paged call over the whole context: the same answer
    whole = attn.run_prefill(*args)
    attn.split = split
    assert rel_err(cp.asnumpy(whole), cp.asnumpy(got).astype(np.float32)) < 1e-2
