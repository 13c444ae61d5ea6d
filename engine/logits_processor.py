"""LogitsProcessor: each request's own logit adjustments, applied before the sampling kernels.

In vLLM's order: ``min_tokens`` (eos and stop token ids to -inf), ``logit_bias``, then the
penalties (repetition over prompt + output, then OpenAI's frequency and presence over the
output), then ``min_p`` for sampled rows. Everything here is indexing and elementwise arithmetic
through the backend's array module (``ops.xp``: NumPy or CuPy, the same calls), so it is the same
computation on both backends; the temperature / top-k / top-p kernels then run unchanged on the
adjusted logits. ``min_p`` is expressed on logits: a token's probability after temperature ``T``
is below ``min_p`` times the top one exactly when ``logit < max_logit + T * ln(min_p)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from engine.sequence import Sequence
from kernels.ops import Array, Ops


class LogitsProcessor:
    """Adjusts the rows of requests whose params ask for it; the others are not touched."""

    def __init__(self, ops: Ops, eos_token_ids: Iterable[int]) -> None:
        self.ops = ops
        self._eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: Array, seqs: list[Sequence]) -> Array:
        """``logits[len(seqs), V]`` float32 -> the adjusted logits: the same array when no row
        changes, else a copy (the input may be a captured graph's output buffer)."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
        if not rows:
            return logits
        logits = logits.copy()
        for i in rows:
            self._adjust_row(logits, i, seqs[i])
        return logits

    def _adjust_row(self, logits: Array, row: int, seq: Sequence) -> None:
        params = seq.params
        xp, vocab = self.ops.xp, logits.shape[1]
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            banned = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                banned.update(self._eos_token_ids)
            banned_ids = [i for i in banned if i < vocab]
            if banned_ids:
                logits[row, self._ids(banned_ids)] = -np.inf
        if params.logit_bias:
            ids = [i for i in params.logit_bias if i < vocab]
            biases = np.array([params.logit_bias[i] for i in ids], dtype=np.float32)
            logits[row, self._ids(ids)] += self.ops.to_device(biases)
        if params.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(seq.token_ids, dtype=np.int64))
            seen_ids = self._ids(seen[seen < vocab])
            values = logits[row, seen_ids]
            penalty = np.float32(params.repetition_penalty)
            logits[row, seen_ids] = xp.where(values > 0, values / penalty, values * penalty)
        if params.frequency_penalty or params.presence_penalty:
            out_ids, counts = np.unique(np.asarray(seq.output_token_ids, dtype=np.int64),
                                        return_counts=True)
            keep = out_ids < vocab
            if keep.any():
                subtract = (params.frequency_penalty * counts[keep]
                            + params.presence_penalty).astype(np.float32)
                logits[row, self._ids(out_ids[keep])] -= self.ops.to_device(subtract)
        if params.min_p > 0.0 and not params.greedy:
            values = logits[row]  # a view: the masked assignment writes into logits
            floor = values.max() + np.float32(params.temperature * math.log(params.min_p))
            values[values < floor] = -np.inf

    def _ids(self, ids: Iterable[int] | np.ndarray) -> Array:
        return self.ops.to_device(np.asarray(list(ids) if not isinstance(ids, np.ndarray)
                                             else ids, dtype=np.int64))
