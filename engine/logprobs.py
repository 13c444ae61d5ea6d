"""TokenLogprobs: a token's log-probability, its rank and the most likely alternatives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprobs:
    """``logprob`` of ``token_id``; ``top`` the ``n`` most likely ids with theirs, most likely
    first (equal ones: lower id first); ``rank`` the token's place in the vocabulary by logprob
    (1: the most likely; vLLM's, counting every token at least as likely, itself included).
    Computed from the model's raw logits (vLLM's default)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 1


def token_logprobs(logits: np.ndarray, token_ids: list[int], num_top: list[int]
                   ) -> list[TokenLogprobs]:
    """Row ``b`` of ``logits[B, V]`` (host float32) gives ``token_ids[b]``'s entry with
    ``num_top[b]`` alternatives; log-softmax in float64."""
    rows = logits.astype(np.float64)
    rows -= rows.max(axis=-1, keepdims=True)
    rows -= np.log(np.exp(rows).sum(axis=-1, keepdims=True))
    out = []
    for row, token_id, n in zip(rows, token_ids, num_top):
        top: tuple[tuple[int, float], ...] = ()
        if n:
            # a partial sort for the n best, then a stable order among them
            best = np.argpartition(-row, n - 1)[:n] if n < row.size else np.arange(row.size)
            best = best[np.lexsort((best, -row[best]))]
            top = tuple((int(i), float(row[i])) for i in best)
        logprob = row[token_id]
        out.append(TokenLogprobs(int(token_id), float(logprob), top,
                                 int(np.count_nonzero(row >= logprob))))
    return out
