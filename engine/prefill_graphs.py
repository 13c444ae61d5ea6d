"""Short prefill steps replayed from CUDA graphs: a turn's last tokens after an HBM hit or a
restore (a few dozen new tokens over a long cached history) cost ~470 kernel launches, ~15 ms
of Python at 16k context where the device needs a few ms; a graph replays them for ~1.3 us each.

Buckets: the exact number of sequences (1 to ``MAX_SEQS``) and the padded token count (16, 32,
..., 256, then steps of 256 up to the engine's ``max_prefill_graph_tokens``: a first turn's few
hundred tokens over a cached system prompt are launch-bound as well), one table width for all
(the longest context plus the padding), so the split attention's cuDNN graphs and our captures
do not multiply with context lengths. Padding rows join the last sequence without writing KV or
touching the real rows (``engine/step_inputs.pack_prefill``). A step qualifies when every
sequence samples (no mid-prompt chunk). The warm-up captures ``warm_buckets`` and seals (no
capture in a request's path from then on); without it, captured on first use.
"""

from __future__ import annotations

import bisect

from engine.config import DEFAULT_MAX_PREFILL_GRAPH_TOKENS, MIN_PREFILL_GRAPH_TOKENS
from engine.models.decoder import DecoderModel, ForwardBatch
from engine.step_inputs import StepLayout
from kernels.ops import Array, CapturedGraph, Ops

MAX_SEQS = 4
_MIN_TOKENS = MIN_PREFILL_GRAPH_TOKENS
# Past it, buckets grow by this much: a step pads at most 255 rows, in every bucket (below it
# less than half a power of two).
_STEP_TOKENS = 256
_WARM_TOKENS = (_STEP_TOKENS,)


def token_buckets(max_tokens: int = DEFAULT_MAX_PREFILL_GRAPH_TOKENS) -> list[int]:
    """The padded token counts, ascending: powers of two from 16 to 256, then multiples of 256,
    up to ``max_tokens`` (rounded up to a bucket)."""
    if max_tokens < _MIN_TOKENS:
        raise ValueError(f"prefill graphs need at least {_MIN_TOKENS} tokens, got {max_tokens}")
    sizes, size = [], _MIN_TOKENS
    while size < min(max_tokens, _STEP_TOKENS):
        sizes.append(size)
        size *= 2
    sizes.append(size)
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] + _STEP_TOKENS)
    return sizes


def warm_buckets(tokens: list[int]) -> list[tuple[int, int]]:
    """(sequences, tokens) a warm-up captures: one sequence at each of ``tokens``, two to
    ``MAX_SEQS`` at the largest."""
    several = [t for t in tokens if t in _WARM_TOKENS] or tokens[-1:]
    return [(1, t) for t in tokens] + [(s, t) for s in range(2, MAX_SEQS + 1) for t in several]


class _Bucket:
    """One captured prefill step: its static inputs on the device and the graph over them."""

    def __init__(self, ops: Ops, model: DecoderModel, kv_cache: Array, layout: StepLayout
                 ) -> None:
        xp = ops.xp
        self.inputs = xp.zeros(layout.bounds[-1], dtype="int32")
        views = layout.views(self.inputs)
        # the warm-up and the capture run an idle step: each sequence a share of the rows over
        # its own one-block-or-more context in block 0, no KV write
        num_seqs, num_tokens = layout.num_seqs, layout.num_tokens
        ends = [(b + 1) * num_tokens // num_seqs for b in range(num_seqs)]
        starts = [0] + ends[:-1]
        views["slot_mapping"][:] = -1
        views["cu_seqlens_q"][1:] = xp.asarray(ends, dtype="int32")
        views["context_lens"][:] = xp.asarray([e - s for s, e in zip(starts, ends)],
                                              dtype="int32")
        views["logits_indices"][:] = xp.asarray([e - 1 for e in ends], dtype="int32")
        batch = ForwardBatch(is_decode=False, max_query_len=num_tokens, **views)
        self.graph: CapturedGraph = ops.capture_graph(
            lambda: model.forward(batch, kv_cache),
            key=("prefill", layout.num_seqs, layout.num_tokens))


class PrefillGraphs:
    """Owns the captured short prefill steps of one model on one KV arena."""

    def __init__(self, ops: Ops, model: DecoderModel, kv_cache: Array, max_table_width: int,
                 block_size: int,
                 max_tokens: int = DEFAULT_MAX_PREFILL_GRAPH_TOKENS) -> None:
        if not ops.supports_graphs:
            raise ValueError(f"the {ops.name} backend has no graphs")
        self.ops, self.model, self.kv_cache = ops, model, kv_cache
        self.tokens = token_buckets(max_tokens)
        # room for the padding rows' keys past the longest context
        self.table_width = max_table_width + -(-_STEP_TOKENS // block_size) + 1
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self.sealed = False
        self.num_replays = 0
        self.num_captures = 0

    def bucket(self, num_seqs: int, num_tokens: int) -> tuple[int, int] | None:
        """(sequences, padded tokens) of the bucket that holds the step, or None (eager)."""
        i = bisect.bisect_left(self.tokens, num_tokens)
        if num_seqs > MAX_SEQS or i == len(self.tokens) or num_tokens < num_seqs:
            return None
        if not self.sealed:
            return num_seqs, self.tokens[i]
        # after the warm-up: the smallest captured bucket (never a capture in a request's path)
        return next(((num_seqs, t) for t in self.tokens[i:] if (num_seqs, t) in self._buckets),
                    None)

    def warm_buckets(self) -> list[tuple[int, int]]:
        """The buckets the warm-up captures: one sequence at every token count, several at
        256 tokens only (a padded 256-token step costs a few ms, each capture ~60 ms of start
        time on an H200)."""
        return warm_buckets(self.tokens)

    def seal(self) -> None:
        """From now on ``bucket`` names captured buckets only (the rest run eagerly)."""
        self.sealed = True

    def run(self, key: tuple[int, int], host_inputs) -> Array:
        """Replay bucket ``key`` on ``host_inputs`` (``pack_prefill`` for its layout); returns
        the graph's logits buffer (one row per sequence; valid until the next replay)."""
        bucket = self._buckets.get(key) or self.capture(*key)
        bucket.inputs.set(host_inputs)
        self.num_replays += 1
        return bucket.graph.replay()

    def capture(self, num_seqs: int, num_tokens: int) -> _Bucket:
        """Capture bucket (``num_seqs``, ``num_tokens``) now (idempotent)."""
        key = (num_seqs, num_tokens)
        if key not in self._buckets:
            layout = StepLayout(num_tokens, num_seqs, self.table_width)
            self._buckets[key] = _Bucket(self.ops, self.model, self.kv_cache, layout)
            self.num_captures += 1
        return self._buckets[key]
