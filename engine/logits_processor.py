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
            seen_ids = self._row(seq).seen_ids(seq, vocab, self.ops)
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


class _TokenTally:
    """How often each id occurs in ``token_ids[start:]`` of a growing list, grown by the tokens
    appended since the last call; the ids that occur, ascending, go to the device again only when
    a new one joined them."""

    def __init__(self, vocab: int, start: int) -> None:
        self._vocab = vocab
        self._counts = np.zeros(vocab, dtype=np.int32)
        self._num_counted = start  # leading token_ids counted (or skipped)
        self._ids: tuple[Array, np.ndarray] | None = None  # device and host; None: stale

    def update(self, token_ids: list[int], ops: Ops) -> Array:
        """The ids that occur, on the device, ascending (``counts`` has how often)."""
        if len(token_ids) > self._num_counted:  # token_ids only grows
            new = np.asarray(token_ids[self._num_counted:], dtype=np.int64)
            self._num_counted = len(token_ids)
            new = new[new < self._vocab]
            if not self._counts[new].all():
                self._ids = None
            np.add.at(self._counts, new, 1)
        if self._ids is None:
            ids = np.flatnonzero(self._counts > 0)  # a bool scan: 7x faster than on int32
            self._ids = ops.to_device(ids), ids
        return self._ids[0]

    def counts(self) -> np.ndarray:
        """How often each id ``update`` returned occurs, in its order."""
        assert self._ids is not None, "update first"
        return self._counts[self._ids[1]]


class _RowCache:
    """One sequence's arrays that its adjustments reuse: the logit bias on the device, built
    once; the ids in prompt and output (repetition penalty) and the output's counts (frequency
    and presence penalties), each a tally grown by the new tokens."""

    def __init__(self) -> None:
        self._bias: tuple[Array, Array] | None = None
        self._seen: _TokenTally | None = None
        self._output: _TokenTally | None = None

    def bias(self, logit_bias, vocab: int, ops: Ops) -> tuple[Array, Array]:
        if self._bias is None:
            ids = np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias))
            values = np.fromiter(logit_bias.values(), dtype=np.float32, count=len(logit_bias))
            keep = ids < vocab
            self._bias = ops.to_device(ids[keep]), ops.to_device(values[keep])
        return self._bias

    def seen_ids(self, seq: Sequence, vocab: int, ops: Ops) -> Array:
        """The ids in the prompt and the output, on the device, ascending."""
        if self._seen is None:
            self._seen = _TokenTally(vocab, 0)
        return self._seen.update(seq.token_ids, ops)

    def output_counts(self, seq: Sequence, vocab: int, ops: Ops) -> tuple[Array, np.ndarray]:
        """The ids in the output (on the device, ascending) and how often each occurs."""
        if self._output is None:
            self._output = _TokenTally(vocab, len(seq.token_ids) - seq.num_output_tokens)
        return self._output.update(seq.token_ids, ops), self._output.counts()
