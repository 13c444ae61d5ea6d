"""Every kernel reference against an independent, simpler formula of the same thing."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import reference as ref
from kernels.numpy_ops import NumpyOps, bf16_bits_to_float32
from kernels.ops import Ops

RNG = np.random.default_rng(1234)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_numpy_ops_implements_every_op() -> None:
    ops = NumpyOps()
    assert isinstance(ops, Ops)
    for name in Ops.__abstractmethods__:
        assert callable(getattr(ops, name))


def test_embedding_is_one_hot_matmul() -> None:
    table = randn(50, 8)
    ids = np.array([3, 0, 49, 3], dtype=np.int32)
    one_hot = np.eye(50, dtype=np.float32)[ids]
    np.testing.assert_allclose(ref.embedding(ids, table), one_hot @ table, rtol=0, atol=0)


def test_rms_norm_matches_row_formula() -> None:
    x, w = randn(5, 3, 16), randn(16)
    out, residual = ref.rms_norm(x, w, 1e-6)
    assert residual is None
    expected = np.stack([r / np.sqrt((r.astype(np.float64) ** 2).mean() + 1e-6) * w
                         for r in x.reshape(-1, 16)]).reshape(x.shape)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_fused_residual_add() -> None:
    x, r, w = randn(7, 32), randn(7, 32), randn(32)
    out, new_residual = ref.rms_norm(x, w, 1e-5, residual=r)
    np.testing.assert_array_equal(new_residual, x + r)
    plain, _ = ref.rms_norm(x + r, w, 1e-5)
    np.testing.assert_array_equal(out, plain)


def test_rope_is_complex_rotation() -> None:
    num_tokens, head_dim = 6, 8
    half = head_dim // 2
    q, k = randn(num_tokens, 4, head_dim), randn(num_tokens, 2, head_dim)
    positions = np.array([0, 1, 5, 17, 100, 3], dtype=np.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(half) * 2 / head_dim))
    angles = np.arange(128)[:, None] * inv_freq[None, :]
    cache = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
    q_out, k_out = ref.rope(q, k, positions, cache)
    for x, out in ((q, q_out), (k, k_out)):
        z = x[..., :half] + 1j * x[..., half:]  # NeoX pairs element i with element i + D/2
        rotated = z * np.exp(1j * positions[:, None, None] * inv_freq[None, None, :])
        expected = np.concatenate([rotated.real, rotated.imag], axis=-1)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    # Position 0 is the identity.
    np.testing.assert_allclose(q_out[0], q[0], atol=1e-7)


def test_silu_and_mul_matches_sigmoid_form() -> None:
    x = randn(5, 2 * 12) * 10
    x[0, 0] = -1000.0  # exp overflow must give silu = -0, not NaN
    gate, up = x[:, :12].astype(np.float64), x[:, 12:].astype(np.float64)
    expected = gate * 0.5 * (1 + np.tanh(gate / 2)) * up
    np.testing.assert_allclose(ref.silu_and_mul(x), expected, rtol=1e-5, atol=1e-5)


def test_write_kv_scatters_to_slots_only() -> None:
    num_blocks, num_layers, block_size, heads, dim = 6, 3, 4, 2, 8
    kv = randn(num_blocks, num_layers, 2, block_size, heads, dim)
    before = kv.copy()
    k, v = randn(5, heads, dim), randn(5, heads, dim)
    slots = np.array([0, 9, 23, 4, 13], dtype=np.int32)
    ref.write_kv(kv, 1, k, v, slots)
    expected = before.copy()
    for t, slot in enumerate(slots):
        expected[slot // block_size, 1, 0, slot % block_size] = k[t]
        expected[slot // block_size, 1, 1, slot % block_size] = v[t]
    np.testing.assert_array_equal(kv, expected)


def _paged_setup(context_lens: list[int], block_size: int, heads_kv: int, dim: int,
                 num_layers: int = 2, layer: int = 1):
    """Contiguous K/V per sequence and the same K/V scattered into shuffled blocks by a loop."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    kv = randn(num_blocks, num_layers, 2, block_size, heads_kv, dim)  # garbage everywhere else
    free = list(RNG.permutation(num_blocks))
    table = np.zeros((len(context_lens), max(blocks_per_seq)), dtype=np.int32)
    dense = []
    for b, n in enumerate(context_lens):
        k, v = randn(n, heads_kv, dim), randn(n, heads_kv, dim)
        dense.append((k, v))
        for j in range(blocks_per_seq[b]):
            table[b, j] = free.pop()
        for pos in range(n):
            block = table[b, pos // block_size]
            kv[block, layer, 0, pos % block_size] = k[pos]
            kv[block, layer, 1, pos % block_size] = v[pos]
    return kv, table, dense


def _dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """softmax(Q K^T * scale + causal mask) V with K/V heads repeated for GQA, in float64."""
    num_q, heads_q, _ = q.shape
    n = k.shape[0]
    group = heads_q // k.shape[1]
    k = np.repeat(k, group, axis=1).astype(np.float64)
    v = np.repeat(v, group, axis=1).astype(np.float64)
    out = np.zeros(q.shape)
    for h in range(heads_q):
        scores = q[:, h].astype(np.float64) @ k[:, h].T * scale
        mask = np.arange(n)[None, :] > (np.arange(n - num_q, n))[:, None]
        scores[mask] = -np.inf
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h]
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_prefill_matches_dense_causal_attention(block_size: int) -> None:
    heads_q, heads_kv, dim = 8, 2, 16
    context_lens = [1, 7, 33, 20]
    q_lens = [1, 7, 5, 1]  # a fresh prompt, a prefix-cached prompt, a decode row mixed in
    kv, table, dense = _paged_setup(context_lens, block_size, heads_kv, dim)
    q = randn(sum(q_lens), heads_q, dim)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    scale = dim**-0.5
    out = ref.paged_attention_prefill(q, kv, 1, table, cu, np.array(context_lens, np.int32),
                                      scale)
    for b, (k, v) in enumerate(dense):
        expected = _dense_attention(q[cu[b]:cu[b + 1]], k, v, scale)
        np.testing.assert_allclose(out[cu[b]:cu[b + 1]], expected, rtol=1e-4, atol=1e-5)


def test_paged_decode_matches_dense_attention() -> None:
    heads_q, heads_kv, dim, block_size = 4, 4, 8, 4
    context_lens = [1, 4, 5, 30]
    kv, table, dense = _paged_setup(context_lens, block_size, heads_kv, dim)
    q = randn(len(context_lens), heads_q, dim)
    out = ref.paged_attention_decode(q, kv, 1, table, np.array(context_lens, np.int32), 0.3)
    for b, (k, v) in enumerate(dense):
        np.testing.assert_allclose(out[b:b + 1], _dense_attention(q[b:b + 1], k, v, 0.3),
                                   rtol=1e-4, atol=1e-5)


def test_argmax_takes_first_maximum() -> None:
    logits = np.array([[1.0, 3.0, 3.0], [5.0, 0.0, 5.0]], dtype=np.float32)
    np.testing.assert_array_equal(ref.argmax(logits), [1, 0])
    assert ref.argmax(logits).dtype == np.int32


def _brute_probs(row: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    p = np.exp((row - row.max()) / temperature)
    p /= p.sum()
    order = sorted(range(len(row)), key=lambda i: (-p[i], i))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(p[i] for i in kept)
    nucleus, running = [], 0.0
    for i in kept:
        if running < top_p * mass or not nucleus:
            nucleus.append(i)
        running += p[i]
    out = np.zeros_like(p)
    out[nucleus] = p[nucleus]
    return out / out.sum()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, 0, 1.0), (0.5, 3, 1.0), (1.3, 0, 0.6), (0.8, 5, 0.3),
                          (2.0, 1, 1.0), (1.0, 0, 1e-6)])
def test_sampling_probs_match_brute_force(temperature: float, top_k: int, top_p: float) -> None:
    logits = randn(4, 20) * 3
    probs = ref.sampling_probs(logits, np.full(4, temperature, np.float32),
                               np.full(4, top_k, np.int32), np.full(4, top_p, np.float32))
    for b in range(4):
        np.testing.assert_allclose(probs[b], _brute_probs(logits[b], temperature, top_k, top_p),
                                   rtol=1e-5, atol=1e-6)
    if top_k == 1 or top_p < 1e-3:
        np.testing.assert_array_equal(np.argmax(probs, axis=1), ref.argmax(logits))
        assert ((probs > 0).sum(axis=1) == 1).all()


def test_sample_from_probs_inverse_cdf() -> None:
    probs = np.array([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32)
    np.testing.assert_array_equal(ref.sample_from_probs(probs, np.array([0.0, 0.0])), [1, 0])
    np.testing.assert_array_equal(ref.sample_from_probs(probs, np.array([0.49, 0.3])), [1, 1])
    np.testing.assert_array_equal(ref.sample_from_probs(probs, np.array([0.5, 0.75])), [3, 3])
    almost_one = np.nextafter(np.float32(1), np.float32(0))
    np.testing.assert_array_equal(ref.sample_from_probs(probs, np.array([almost_one] * 2)), [3, 3])


def test_sample_from_probs_frequencies() -> None:
    p = np.array([0.1, 0.0, 0.6, 0.3], dtype=np.float32)
    uniforms = RNG.random(20000)
    ids = ref.sample_from_probs(np.tile(p, (len(uniforms), 1)), uniforms)
    freq = np.bincount(ids, minlength=4) / len(ids)
    assert freq[1] == 0
    np.testing.assert_allclose(freq, p, atol=0.015)


def test_bf16_widening_is_exact() -> None:
    values = np.array([1.0, -2.5, 0.0078125, 3.140625, -0.0], dtype=np.float32)  # bf16-exact
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(bf16_bits_to_float32(bits), values)
    assert NumpyOps().weight_from_host(bits, "bfloat16").dtype == np.float32
