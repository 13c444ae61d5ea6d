"""Launchers for ``argmax``, ``softmax_temperature`` and ``sample_from_probs`` (sampling.cu);
references: ``kernels.reference.argmax`` / ``sampling_probs`` / ``sample_from_probs``. Top-k and
top-p filtering sort each row with CuPy (a stable device sort), only for rows that ask for it."""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import FLOAT32, INT32, check, contiguous, kernel

_THREADS = 1024


def _as_float32(x):
    import cupy as cp

    return contiguous(x if x.dtype == FLOAT32 else x.astype(cp.float32))


def argmax(logits):
    """First index of each row's maximum: ``logits[B, V]`` -> int32 ``[B]``."""
    import cupy as cp

    logits = _as_float32(logits)
    check(logits, "logits", FLOAT32, 2)
    out = cp.empty(logits.shape[0], dtype=INT32)
    if logits.shape[0]:
        kernel("sampling", "argmax")((logits.shape[0],), (_THREADS,),
                                     (logits, out, np.int32(logits.shape[1])))
    return out


def sampling_probs(logits, temperatures, top_ks, top_ps):
    """Temperature softmax, then top-k (0 = off), then top-p (1.0 = off), renormalized; float32
    ``[B, V]`` with dropped ids at exactly 0 (ties broken by lower id, as the reference)."""
    import cupy as cp

    logits = _as_float32(logits)
    temperatures, top_ks, top_ps = (contiguous(a) for a in (temperatures, top_ks, top_ps))
    check(logits, "logits", FLOAT32, 2)
    check(temperatures, "temperatures", FLOAT32, 1)
    check(top_ks, "top_ks", INT32, 1)
    check(top_ps, "top_ps", FLOAT32, 1)
    num_rows, vocab = logits.shape
    probs = cp.empty_like(logits)
    if num_rows == 0:
        return probs
    kernel("sampling", "softmax_temperature")((num_rows,), (_THREADS,),
                                              (logits, temperatures, probs, np.int32(vocab)))
    filtered = (top_ks > 0) | (top_ps < 1.0)
    if not bool(filtered.any()):
        return probs
    order = cp.argsort(-probs, axis=-1)  # CuPy's sort is stable: ties keep the lower id first
    sorted_probs = cp.take_along_axis(probs, order, axis=-1)
    ranks = cp.arange(vocab, dtype=INT32)[None, :]
    ks = cp.where(top_ks > 0, top_ks, vocab)[:, None]
    keep_sorted = ranks < ks
    sorted_probs = cp.where(keep_sorted, sorted_probs, cp.float32(0))
    mass_before = cp.cumsum(sorted_probs, axis=-1) - sorted_probs
    total = sorted_probs.sum(axis=-1, keepdims=True)
    keep_sorted &= mass_before < top_ps[:, None] * total
    keep_sorted[:, 0] = True
    keep = cp.zeros_like(keep_sorted)
    keep[cp.arange(num_rows)[:, None], order] = keep_sorted
    probs = cp.where(keep, probs, cp.float32(0))
    return probs / probs.sum(axis=-1, keepdims=True)


def sample_from_probs(probs, uniforms):
    """Inverse-CDF draw of one id per row of ``probs[B, V]`` with ``uniforms[B]`` -> int32
    ``[B]``."""
    import cupy as cp

    probs, uniforms = _as_float32(probs), contiguous(uniforms)
    check(probs, "probs", FLOAT32, 2)
    check(uniforms, "uniforms", FLOAT32, 1)
    out = cp.empty(probs.shape[0], dtype=INT32)
    if probs.shape[0]:
        kernel("sampling", "sample_from_probs")((probs.shape[0],), (_THREADS,),
                                                (probs, uniforms, out, np.int32(probs.shape[1])))
    return out
