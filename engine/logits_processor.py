"""LogitsProcessor: each request's own logit adjustments, applied before the sampling kernels.

In vLLM's order: ``min_tokens`` (eos and stop token ids to -inf), ``logit_bias``, then the
penalties (repetition over prompt + output, then OpenAI's frequency and presence over the
output), then ``min_p`` for sampled rows. Everything here is indexing and elementwise arithmetic
through the backend's array module (``ops.xp``: NumPy or CuPy, the same calls), so it is the same
computation on both backends; the temperature / top-k / top-p kernels then run unchanged on the
adjusted logits. ``min_p`` is expressed on logits: a token's probability after temperature ``T``
is below ``min_p`` times the top one exactly when ``logit < max_logit + T * ln(min_p)``.

Per step, a row costs the size of what it touches, not of what the request brought: its
``logit_bias`` arrays are built once, and the ids its repetition penalty covers (prompt and output)
and the output's counts (frequency and presence penalties) are kept per sequence and grown by
the new tokens only (a 40k-token prompt's ``np.unique`` each step cost milliseconds of the step
every request shares).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import numpy as np

from engine.sequence import Sequence
from kernels.ops import Array, Ops


class LogitsProcessor:
    """Adjusts the rows of requests whose params ask for it; the others are not touched."""

    def __init__(self, ops: Ops, eos_token_ids: Iterable[int]) -> None:
        self.ops = ops
        self._eos_token_ids = tuple(eos_token_ids)
        # what each live sequence's adjustments reuse from step to step (gone with it)
        self._rows: weakref.WeakKeyDictionary[Sequence, _RowCache] = weakref.WeakKeyDictionary()

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
            bias_ids, biases = self._row(seq).bias(params.logit_bias, vocab, self.ops)
            logits[row, bias_ids] += biases
        if params.repetition_penalty != 1.0:
            seen_ids = self._row(seq).seen_ids(seq.token_ids, vocab, self.ops)
            values = logits[row, seen_ids]
            penalty = np.float32(params.repetition_penalty)
            logits[row, seen_ids] = xp.where(values > 0, values / penalty, values * penalty)
        if params.frequency_penalty or params.presence_penalty:
            out_ids, counts = self._row(seq).output_counts(seq, vocab, self.ops)
            if len(counts):
                subtract = (params.frequency_penalty * counts
                            + params.presence_penalty).astype(np.float32)
                logits[row, out_ids] -= self.ops.to_device(subtract)
        if params.min_p > 0.0 and not params.greedy:
            values = logits[row]  # a view: the masked assignment writes into logits
            floor = values.max() + np.float32(params.temperature * math.log(params.min_p))
            values[values < floor] = -np.inf

    def _row(self, seq: Sequence) -> _RowCache:
        cache = self._rows.get(seq)
        if cache is None:
            cache = self._rows[seq] = _RowCache()
        return cache

    def _ids(self, ids: Iterable[int] | np.ndarray) -> Array:
        return self.ops.to_device(np.asarray(list(ids) if not isinstance(ids, np.ndarray)
                                             else ids, dtype=np.int64))


class _RowCache:
    """One sequence's arrays that its adjustments reuse: the logit bias on the device, built
    once; the ids seen in prompt and output (a mask) and the output's counts per id, both grown by
    each step's new tokens, their ids sent to the device again only when a new id joined them."""

    def __init__(self) -> None:
        self._bias: tuple[Array, Array] | None = None
        self._seen: np.ndarray | None = None  # bool[vocab]
        self._num_seen_tokens = 0  # leading token_ids folded into _seen
        self._seen_ids: Array | None = None  # None: stale
        self._counts: np.ndarray | None = None  # int32[vocab]: each id's count in the output
        self._num_counted_tokens = 0  # leading token_ids (prompt included) counted
        self._out_ids: tuple[Array, np.ndarray] | None = None  # device and host; None: stale

    def bias(self, logit_bias, vocab: int, ops: Ops) -> tuple[Array, Array]:
        if self._bias is None:
            ids = np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias))
            values = np.fromiter(logit_bias.values(), dtype=np.float32, count=len(logit_bias))
            keep = ids < vocab
            self._bias = ops.to_device(ids[keep]), ops.to_device(values[keep])
        return self._bias

    def seen_ids(self, token_ids: list[int], vocab: int, ops: Ops) -> Array:
        if self._seen is None:
            self._seen = np.zeros(vocab, dtype=bool)
        if len(token_ids) > self._num_seen_tokens:  # token_ids only grows
            new = np.asarray(token_ids[self._num_seen_tokens:], dtype=np.int64)
            self._num_seen_tokens = len(token_ids)
            new = new[new < vocab]
            if not self._seen[new].all():
                self._seen[new] = True
                self._seen_ids = None
        if self._seen_ids is None:
            self._seen_ids = ops.to_device(np.flatnonzero(self._seen).astype(np.int64))
        return self._seen_ids

    def output_counts(self, seq: Sequence, vocab: int, ops: Ops) -> tuple[Array, np.ndarray]:
        """The ids in the output (on the device, ascending) and how often each occurs."""
        token_ids = seq.token_ids
        if self._counts is None:
            self._counts = np.zeros(vocab, dtype=np.int32)
            self._num_counted_tokens = len(token_ids) - seq.num_output_tokens
        if len(token_ids) > self._num_counted_tokens:
            new = np.asarray(token_ids[self._num_counted_tokens:], dtype=np.int64)
            self._num_counted_tokens = len(token_ids)
            new = new[new < vocab]
            if not self._counts[new].all():
                self._out_ids = None
            np.add.at(self._counts, new, 1)
        if self._out_ids is None:
            ids = np.flatnonzero(self._counts).astype(np.int64)
            self._out_ids = ops.to_device(ids), ids
        device_ids, ids = self._out_ids
        return device_ids, self._counts[ids]
