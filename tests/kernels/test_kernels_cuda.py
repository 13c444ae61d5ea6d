"""Every CUDA kernel against its NumPy reference (kernels/reference.py), on bf16-rounded inputs.

Inputs are drawn in float32, rounded to bf16 once, and the reference runs in float32 on the rounded
values: what remains is the kernel's own rounding (bf16 outputs, bf16 P in attention) and the
summation order. Copies (embedding, write_kv, the residual add) must be bit-exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import reference as ref

pytestmark = pytest.mark.gpu


def rounded(x: np.ndarray, bf16) -> np.ndarray:
    """``x`` rounded to bf16 and widened back to float32 (what the GPU sees)."""
    return x.astype(bf16).astype(np.float32)


def assert_close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    scale = float(np.abs(want).max()) + 1e-6
    err = float(np.abs(got.astype(np.float32) - want).max())
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


def test_make_ops_cuda_implements_every_op() -> None:
    from kernels import make_ops
    from kernels.ops import Ops

    ops = make_ops("cuda")
    assert isinstance(ops, Ops) and ops.kv_dtype == "bfloat16"
    for name in Ops.__abstractmethods__:
        assert callable(getattr(ops, name))


@pytest.mark.parametrize("hidden", [256, 20])
def test_embedding_gathers_rows_exactly(cp, bf16, hidden: int) -> None:
    from kernels.embedding import embedding

    rng = np.random.default_rng(0)
    table = rng.standard_normal((300, hidden)).astype(bf16)
    ids = np.array([5, 0, 299, 5, 17], dtype=np.int32)
    got = cp.asnumpy(embedding(cp.asarray(ids), cp.asarray(table)))
    np.testing.assert_array_equal(got.view(np.uint16), ref.embedding(ids, table).view(np.uint16))


@pytest.mark.parametrize("shape", [(7, 2560), (9, 4, 128), (5, 20)])
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_matches_reference(cp, bf16, shape: tuple[int, ...], fused: bool) -> None:
    from kernels.rms_norm import rms_norm

    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(bf16)
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(bf16)
    r = rng.standard_normal(shape).astype(bf16) if fused else None
    out, new_r = rms_norm(cp.asarray(x), cp.asarray(w), 1e-6,
                          cp.asarray(r) if fused else None)
    if fused:  # the new residual stream is the bf16 sum, bit for bit; the norm is of that sum
        summed = x + r
        np.testing.assert_array_equal(cp.asnumpy(new_r).view(np.uint16), summed.view(np.uint16))
    else:
        summed = x
        assert new_r is None
    want, _ = ref.rms_norm(summed.astype(np.float32), w.astype(np.float32), 1e-6)
    assert_close(cp.asnumpy(out), want, 1e-2)


def test_rope_matches_reference_at_long_positions(cp, bf16) -> None:
    from engine.model_config import RopeConfig
    from engine.models.rope import cos_sin_cache
    from kernels.rope import rope

    rng = np.random.default_rng(2)
    table = cos_sin_cache(RopeConfig(theta=1e6), 128, 40960)
    q = rng.standard_normal((11, 8, 128)).astype(bf16)
    k = rng.standard_normal((11, 2, 128)).astype(bf16)
    pos = rng.integers(0, 40960, 11).astype(np.int32)
    gq, gk = rope(cp.asarray(q), cp.asarray(k), cp.asarray(pos), cp.asarray(table))
    rq, rk = ref.rope(q.astype(np.float32), k.astype(np.float32), pos, table)
    assert_close(cp.asnumpy(gq), rq, 1e-2)
    assert_close(cp.asnumpy(gk), rk, 1e-2)


@pytest.mark.parametrize("width", [96, 13])
def test_silu_and_mul_matches_reference(cp, bf16, width: int) -> None:
    from kernels.activation import silu_and_mul

    x = (np.random.default_rng(3).standard_normal((6, 2 * width)) * 4).astype(bf16)
    got = silu_and_mul(cp.asarray(x))
    assert_close(cp.asnumpy(got), ref.silu_and_mul(x.astype(np.float32)), 1e-2)


def test_linear_with_bias_matches_numpy(cp, bf16) -> None:
    from kernels import make_ops

    ops = make_ops("cuda")
    rng = np.random.default_rng(4)
    x, w, b = (rng.standard_normal(s).astype(bf16) for s in ((5, 64), (48, 64), (48,)))
    got = ops.linear(cp.asarray(x), cp.asarray(w), cp.asarray(b))
    want = x.astype(np.float32) @ w.astype(np.float32).T + b.astype(np.float32)
    assert_close(cp.asnumpy(got), want, 1e-2)


def _paged_case(rng, bf16, block_size: int, context_lens: list[int], num_kv_heads: int,
                head_dim: int, num_layers: int = 2):
    """A bf16 arena with random contents and shuffled block tables for ``context_lens``."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    kv = rng.standard_normal((num_blocks, num_layers, 2, block_size, num_kv_heads,
                              head_dim)).astype(bf16)
    tables = np.zeros((len(context_lens), max(blocks_per_seq)), dtype=np.int32)
    perm = rng.permutation(num_blocks).astype(np.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[start:start + n]
        start += n
    return kv, tables


def test_write_kv_scatters_bit_exact(cp, bf16) -> None:
    from kernels.write_kv import write_kv

    rng = np.random.default_rng(5)
    kv, tables = _paged_case(rng, bf16, 16, [37, 5], 2, 64, num_layers=3)
    slots = np.concatenate([tables[b, p // 16] * 16 + p % 16
                            for b, p in enumerate([np.arange(37), np.arange(5)])]).astype(np.int32)
    k = rng.standard_normal((len(slots), 2, 64)).astype(bf16)
    v = rng.standard_normal((len(slots), 2, 64)).astype(bf16)
    arena = cp.asarray(kv)
    write_kv(arena, 2, cp.asarray(k), cp.asarray(v), cp.asarray(slots))
    ref.write_kv(kv, 2, k, v, slots)
    np.testing.assert_array_equal(cp.asnumpy(arena).view(np.uint16), kv.view(np.uint16))


PREFILL_CASES = [
    # block_size, context_lens, q_lens, Hq, Hkv, D
    (16, [5, 40], [5, 3], 4, 2, 16),              # the engine test's shape
    (16, [300, 70, 1, 200], [300, 1, 1, 77], 8, 2, 64),  # prefix hits, decode rows mixed in
    (32, [1100], [1100], 8, 8, 128),              # many query and key tiles, MHA
    (16, [129, 64], [65, 64], 32, 8, 128),        # Qwen3-4B heads, tile edges
]


def _prefill_against_reference(cp, bf16, case, seed: int, **variant):
    """(ours, reference) of one PREFILL_CASES-shaped case; ``variant``: launcher keywords."""
    from kernels.attention import paged_attention_prefill

    block_size, lens, q_lens, num_q_heads, num_kv_heads, head_dim = case
    rng = np.random.default_rng(seed)
    kv, tables = _paged_case(rng, bf16, block_size, lens, num_kv_heads, head_dim)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), num_q_heads, head_dim)).astype(bf16)
    ctx = np.array(lens, dtype=np.int32)
    scale = head_dim ** -0.5
    got = paged_attention_prefill(cp.asarray(q), cp.asarray(kv), 1, cp.asarray(tables),
                                  cp.asarray(cu), cp.asarray(ctx), scale, **variant)
    want = ref.paged_attention_prefill(q.astype(np.float32), kv.astype(np.float32), 1, tables,
                                       cu, ctx, scale)
    return cp.asnumpy(got), want


@pytest.mark.parametrize("use_ldmatrix,num_warps,rows_per_warp,keys_per_tile",
                         [(True, 4, 32, 64), (True, 8, 32, 64), (False, 4, 32, 64),
                          (True, 4, 32, 32), (True, 8, 32, 32), (True, 8, 16, 64),
                          (True, 4, 16, 32), (False, 8, 16, 32)])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_paged_prefill_matches_reference(cp, bf16, case, use_ldmatrix: bool, num_warps: int,
                                         rows_per_warp: int, keys_per_tile: int) -> None:

    got, want = _prefill_against_reference(cp, bf16, case, 6, use_ldmatrix=use_ldmatrix,
                                           num_warps=num_warps, rows_per_warp=rows_per_warp,
                                           keys_per_tile=keys_per_tile)
    assert_close(got, want, 2e-2)


DECODE_CASES = [
    # block_size, context_lens, Hq, Hkv, D
    (16, [5, 40], 4, 2, 16),
    (16, [3000], 32, 8, 128),                  # one sequence: split over the context
    (16, [1, 17, 64, 65, 500, 129], 16, 4, 64),
    (16, [700, 33], 32, 1, 128),               # group of 32 > 16: the prefill kernel serves it
]


@pytest.mark.parametrize("use_ldmatrix", [True, False])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_paged_decode_matches_reference(cp, bf16, case, use_ldmatrix: bool) -> None:
    from kernels.attention import paged_attention_decode

    block_size, lens, num_q_heads, num_kv_heads, head_dim = case
    rng = np.random.default_rng(7)
    kv, tables = _paged_case(rng, bf16, block_size, lens, num_kv_heads, head_dim)
    q = rng.standard_normal((len(lens), num_q_heads, head_dim)).astype(bf16)
    ctx = np.array(lens, dtype=np.int32)
    got = paged_attention_decode(cp.asarray(q), cp.asarray(kv), 0, cp.asarray(tables),
                                 cp.asarray(ctx), 0.1, use_ldmatrix)
    want = ref.paged_attention_decode(q.astype(np.float32), kv.astype(np.float32), 0, tables,
                                      ctx, 0.1)
    assert_close(cp.asnumpy(got), want, 2e-2)


def test_decode_equals_prefill_of_one_token(cp, bf16) -> None:
    """The two attention kernels agree where their contracts overlap (q_len = 1)."""
    from kernels.attention import paged_attention_decode, paged_attention_prefill

    rng = np.random.default_rng(8)
    lens = [900, 31, 64]
    kv, tables = _paged_case(rng, bf16, 16, lens, 2, 128)
    q = cp.asarray(rng.standard_normal((3, 8, 128)).astype(bf16))
    args = (cp.asarray(kv), 1, cp.asarray(tables))
    ctx = cp.asarray(np.array(lens, dtype=np.int32))
    dec = cp.asnumpy(paged_attention_decode(q, *args, ctx, 0.09)).astype(np.float32)
    pre = cp.asnumpy(paged_attention_prefill(q, *args, cp.arange(4, dtype=cp.int32), ctx,
                                             0.09)).astype(np.float32)
    assert_close(dec, pre, 1e-2)


def test_argmax_takes_the_first_maximum(cp) -> None:
    from kernels.sampling import argmax

    rng = np.random.default_rng(9)
    logits = rng.standard_normal((4, 151936)).astype(np.float32)
    logits[1, [7, 70000, 151935]] = 50.0  # a tie: the lowest id wins
    logits[2, -1] = 60.0
    np.testing.assert_array_equal(cp.asnumpy(argmax(cp.asarray(logits))), ref.argmax(logits))


def test_sampling_probs_matches_reference(cp) -> None:
    from kernels.sampling import sampling_probs

    rng = np.random.default_rng(10)
    logits = (rng.standard_normal((5, 1000)) * 3).astype(np.float32)
    logits[4, :10] = 2.5  # ties across the top-k / top-p edge
    temps = np.array([1.0, 0.5, 2.0, 0.7, 1.0], dtype=np.float32)
    top_ks = np.array([0, 3, 1, 50, 5], dtype=np.int32)
    top_ps = np.array([1.0, 0.5, 0.9, 0.8, 1.0], dtype=np.float32)
    got = sampling_probs(*(cp.asarray(a) for a in (logits, temps, top_ks, top_ps)))
    np.testing.assert_allclose(cp.asnumpy(got), ref.sampling_probs(logits, temps, top_ks, top_ps),
                               atol=1e-5)
    plain = sampling_probs(cp.asarray(logits[:2]), cp.asarray(temps[:2]),
                           cp.zeros(2, dtype=cp.int32), cp.ones(2, dtype=cp.float32))
    want = ref.sampling_probs(logits[:2], temps[:2], np.zeros(2, np.int32), np.ones(2, np.float32))
    np.testing.assert_allclose(cp.asnumpy(plain), want, atol=1e-6)


def test_sample_from_probs_matches_reference(cp) -> None:
    from kernels.sampling import sample_from_probs

    rng = np.random.default_rng(11)
    probs = rng.random((6, 151936)).astype(np.float32)
    probs[probs < 0.7] = 0.0  # holes: never drawn
    probs[5, :] = 0.0
    probs[5, 123] = 1.0
    probs /= probs.sum(axis=1, keepdims=True)
    uniforms = np.array([0.0, 0.25, 0.5, 0.999999, 0.73, 0.5], dtype=np.float32)
    got = cp.asnumpy(sample_from_probs(cp.asarray(probs), cp.asarray(uniforms)))
    np.testing.assert_array_equal(got, ref.sample_from_probs(probs, uniforms))
    assert all(probs[i, t] > 0 for i, t in enumerate(got))


@pytest.mark.parametrize("head_dim,norm", [(128, True), (128, False), (64, True), (16, True)])
def test_qkv_prepare_matches_reference(cp, bf16, head_dim: int, norm: bool) -> None:
    """The fused q/k norm + rope + KV write against the composed references; slot -1 skipped."""
    from kernels.qkv_prepare import qkv_prepare

    rng = np.random.default_rng(8)
    num_q, num_kv, num_tokens, block_size = 8, 2, 37, 16
    qkv = rounded(rng.standard_normal((num_tokens, (num_q + 2 * num_kv) * head_dim)), bf16)
    weights = [rounded(1 + 0.1 * rng.standard_normal(head_dim), bf16) for _ in range(2)]
    positions = rng.integers(0, 4000, num_tokens).astype(np.int32)
    angles = np.outer(np.arange(4096), 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim))
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    slots = rng.permutation(6 * block_size)[:num_tokens].astype(np.int32)
    slots[5] = -1
    kv = np.zeros((6, 3, 2, block_size, num_kv, head_dim), dtype=np.float32)
    q_norm, k_norm = (weights if norm else (None, None))
    want_kv = kv.copy()
    want_q = ref.qkv_prepare(qkv, num_q, num_kv, q_norm, k_norm, 1e-6, positions, table, want_kv,
                             1, slots)
    kv_dev = cp.asarray(kv.astype(bf16))
    got_q = qkv_prepare(cp.asarray(qkv.astype(bf16)), num_q, num_kv,
                        None if q_norm is None else cp.asarray(q_norm.astype(bf16)),
                        None if k_norm is None else cp.asarray(k_norm.astype(bf16)), 1e-6,
                        cp.asarray(positions), cp.asarray(table), kv_dev, 1, cp.asarray(slots))
    assert_close(cp.asnumpy(got_q).astype(np.float32), want_q, 1e-2)
    got_kv = cp.asnumpy(kv_dev).astype(np.float32)
    assert_close(got_kv, want_kv, 1e-2)
    assert not got_kv[:, [0, 2]].any()  # other layers untouched


@pytest.mark.parametrize("case", PREFILL_CASES + [(16, [2000, 900], [16, 3], 32, 8, 128)])
def test_paged_prefill_default_variant_matches_reference(cp, bf16, case) -> None:
    """The launcher's own choice (16-row warps for short queries over a long prefix, 256-row
    tiles otherwise) against the reference."""
    got, want = _prefill_against_reference(cp, bf16, case, 9)
    assert_close(got, want, 2e-2)


@pytest.mark.parametrize("keys_per_split,rows_per_warp,keys_per_tile",
                         [(64, 16, 64), (128, 32, 64), (64, 16, 32), (96, 32, 32)])
@pytest.mark.parametrize("case", PREFILL_CASES[:2] + PREFILL_CASES[3:])
def test_paged_prefill_context_splits_match_reference(cp, bf16, case, keys_per_split: int,
                                                      rows_per_warp: int,
                                                      keys_per_tile: int) -> None:
    """Contexts split over CTAs (forced small splits: the diagonal and the splits' ends cut
    tiles, whole splits lie past short contexts) merge to the unsplit result."""
    got, want = _prefill_against_reference(cp, bf16, case, 11, rows_per_warp=rows_per_warp,
                                           keys_per_tile=keys_per_tile,
                                           keys_per_split=keys_per_split)
    assert_close(got, want, 2e-2)


@pytest.mark.parametrize("case", [(16, [3000], [40], 32, 8, 128),
                                  (16, [5000, 3000, 64], [40, 7, 64], 32, 8, 128)])
def test_short_queries_over_long_contexts_split_by_default(cp, bf16, case) -> None:
    """A warm chat turn (a few new tokens over a long cached prefix) fills the GPU by splitting
    the context, and matches the reference."""
    from kernels.attention import prefill_splits

    block_size, lens, q_lens, num_q_heads = case[:4]
    width = -(-max(lens) // block_size) * block_size
    num_tiles = -(-sum(q_lens) // 128) + len(lens) - 1  # the launcher's short-query tiles
    num_splits, _ = prefill_splits(num_q_heads * num_tiles, width)
    assert num_splits > 1
    got, want = _prefill_against_reference(cp, bf16, case, 12)
    assert_close(got, want, 2e-2)


def test_paged_prefill_rejects_a_split_that_is_not_whole_tiles(cp, bf16) -> None:
    with pytest.raises(ValueError, match="keys_per_split"):
        _prefill_against_reference(cp, bf16, PREFILL_CASES[0], 1, keys_per_split=40)
