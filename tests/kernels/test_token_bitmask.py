"""The grammar-mask op: the NumPy reference against a per-token formula (CPU), and the CUDA
kernel against the reference, bit-exact (``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import reference as ref


def _random_case(rng: np.random.Generator, num_rows: int, vocab: int, num_masked: int,
                 extra_words: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    logits = rng.standard_normal((num_rows, vocab)).astype(np.float32)
    rows = np.sort(rng.choice(num_rows, size=num_masked, replace=False)).astype(np.int32)
    num_words = -(-vocab // 32) + extra_words
    bitmask = rng.integers(-(2**31), 2**31, size=(num_masked, num_words),
                           dtype=np.int64).astype(np.int32)
    bitmask[0, :] = -1  # every token allowed: the row must come out unchanged
    if num_masked > 1:
        bitmask[1, :] = 0  # nothing allowed
        bitmask[1, 0] = 1 << 3  # ... but token 3
    return logits, bitmask, rows


def _per_token(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = logits.copy()
    for r, row in enumerate(rows):
        for v in range(logits.shape[1]):
            if not (int(bitmask[r, v // 32]) >> (v % 32)) & 1:
                out[row, v] = -np.inf
    return out


def test_reference_masks_exactly_the_refused_tokens_of_the_named_rows() -> None:
    rng = np.random.default_rng(0)
    logits, bitmask, rows = _random_case(rng, num_rows=6, vocab=101, num_masked=3,
                                         extra_words=1)
    want = _per_token(logits, bitmask, rows)
    got = logits.copy()
    ref.apply_token_bitmask(got, bitmask, rows)
    np.testing.assert_array_equal(got, want)
    free = np.setdiff1d(np.arange(6), rows)
    np.testing.assert_array_equal(got[free], logits[free])  # free rows untouched
    np.testing.assert_array_equal(got[rows[0]], logits[rows[0]])  # all-ones mask: unchanged
    assert np.flatnonzero(np.isfinite(got[rows[1]])).tolist() == [3]


@pytest.mark.gpu
def test_kernel_matches_reference_bit_exact() -> None:
    import cupy as cp

    from kernels.token_bitmask import apply_token_bitmask

    rng = np.random.default_rng(1)
    for num_rows, vocab, num_masked in ((32, 151_936, 1), (32, 151_936, 32), (5, 4_736, 3),
                                        (3, 33, 2)):
        logits, bitmask, rows = _random_case(rng, num_rows, vocab, num_masked)
        want = logits.copy()
        ref.apply_token_bitmask(want, bitmask, rows)
        got = cp.asarray(logits)
        apply_token_bitmask(got, cp.asarray(bitmask), cp.asarray(rows))
        np.testing.assert_array_equal(cp.asnumpy(got), want)


@pytest.mark.gpu
def test_kernel_launcher_checks_shapes() -> None:
    import cupy as cp

    from kernels.token_bitmask import apply_token_bitmask

    logits = cp.zeros((2, 100), dtype=cp.float32)
    with pytest.raises(ValueError, match="covers 64 tokens"):
        apply_token_bitmask(logits, cp.zeros((1, 2), cp.int32), cp.zeros(1, cp.int32))
    with pytest.raises(ValueError, match="row indices"):
        apply_token_bitmask(logits, cp.zeros((1, 4), cp.int32), cp.zeros(2, cp.int32))
    with pytest.raises(TypeError, match="int32"):
        apply_token_bitmask(logits, cp.zeros((1, 4), cp.int64), cp.zeros(1, cp.int32))
