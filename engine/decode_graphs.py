"""Decode steps replayed from CUDA graphs: one graph per (batch rows, block-table width) bucket.

A decode step of qwen3-4b launches about 470 kernels; from Python each costs ~6 us to launch,
which is more than the GPU needs to run most of them. A graph replays them for ~1.3 us each.
Graphs need fixed shapes and fixed addresses, so each bucket owns a static input buffer (the
packed step metadata of ``engine/step_inputs.py``) that every replay reads: a step pads its batch
to the bucket, copies its metadata into that buffer with one host-to-device copy, and replays.

Buckets: rows 1, 2, 4, 8, then multiples of 8 up to 32, then of 16 (as vLLM does), capped at
``max_num_seqs``; table widths are powers of two from 16 blocks up to the longest sequence's
table, so the decode kernel's context split (sized from the table width) is never more than 2x
the real context. Graphs are captured on first use; ``bucket`` says which one a step would use.
"""

from __future__ import annotations

import bisect

from engine.models.decoder import DecoderModel, ForwardBatch
from engine.step_inputs import StepLayout
from kernels.ops import Array, CapturedGraph, Ops

_MIN_TABLE_WIDTH = 16
_WARM_ROWS = (16, 64, 256)
_WARM_MIN_WIDTH = 64


def row_buckets(max_rows: int) -> list[int]:
    """The padded batch sizes, ascending, the last one ``max_rows``."""
    sizes = [1, 2, 4, 8, 16, 24, 32]
    size = 48
    while size < max_rows:
        sizes.append(size)
        size += 16
    return sorted({min(s, max_rows) for s in sizes} | {max_rows})


def width_buckets(max_width: int) -> list[int]:
    """The padded block-table widths, ascending, the last one ``max_width``."""
    widths, width = [], _MIN_TABLE_WIDTH
    while width < max_width:
        widths.append(width)
        width *= 2
    return widths + [max_width]


def warm_buckets(rows: list[int], widths: list[int]) -> list[tuple[int, int]]:
    """The (rows, width) buckets a warm-up captures: one row at every width, then a sparse
    ladder of rows (16, 64, 256 and the largest) at every other width from 64 blocks on.
    Padding a decode batch to more rows costs little (the weights are read once either way),
    nor does a wider table for a short context; every capture costs start time (~50 ms on an
    H200)."""
    ladder = [r for r in rows if r in _WARM_ROWS or r == rows[-1]]
    # batches: every other width from 64 blocks (a table at most 4x the context's)
    wide = [w for w in widths[::-1][::2][::-1] if w >= _WARM_MIN_WIDTH]
    wide = wide if widths[-1] in wide else wide + widths[-1:]
    return [(1, w) for w in widths] + [(r, w) for r in ladder if r > 1 for w in wide]


def smallest_holding(captured: list[tuple[int, int]], num_seqs: int, table_width: int
                     ) -> tuple[int, int] | None:
    """The first of ``captured`` (sorted) with room for ``num_seqs`` rows and ``table_width``
    blocks, or None."""
    return next((key for key in captured if key[0] >= num_seqs and key[1] >= table_width), None)


class _Bucket:
    """One captured decode step: its static inputs on the device and the graph over them."""

    def __init__(self, ops: Ops, model: DecoderModel, kv_cache: Array, layout: StepLayout) -> None:
        xp = ops.xp
        self.inputs = xp.zeros(layout.bounds[-1], dtype="int32")
        views = layout.views(self.inputs)
        # the warm-up and the capture run an idle step: one-token contexts, no KV write
        views["slot_mapping"][:] = -1
        views["context_lens"][:] = 1
        views["cu_seqlens_q"][:] = xp.arange(layout.num_seqs + 1, dtype="int32")
        views["logits_indices"][:] = xp.arange(layout.num_seqs, dtype="int32")
        batch = ForwardBatch(is_decode=True, **views)
        self.graph: CapturedGraph = ops.capture_graph(
            lambda: model.forward(batch, kv_cache),
            key=("decode", layout.num_seqs, layout.table_width))


class DecodeGraphs:
    """Owns the captured decode steps of one model on one KV arena."""

    def __init__(self, ops: Ops, model: DecoderModel, kv_cache: Array, max_rows: int,
                 max_table_width: int) -> None:
        if not ops.supports_graphs:
            raise ValueError(f"the {ops.name} backend has no graphs")
        self.ops, self.model, self.kv_cache = ops, model, kv_cache
        self.rows = row_buckets(max_rows)
        self.widths = width_buckets(max_table_width)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self.sealed = False
        self._captured: list[tuple[int, int]] = []  # sorted, once sealed
        self.num_replays = 0
        self.num_captures = 0

    def bucket(self, num_seqs: int, table_width: int) -> tuple[int, int] | None:
        """(rows, width) of the smallest bucket that holds the step, or None (run it eagerly).
        Once ``sealed`` (after the warm-up) only captured buckets are chosen: a step pads to
        the smallest one that holds it, never waiting for a capture."""
        i = bisect.bisect_left(self.rows, num_seqs)
        j = bisect.bisect_left(self.widths, table_width)
        if i == len(self.rows) or j == len(self.widths):
            return None
        if not self.sealed:
            return self.rows[i], self.widths[j]
        return smallest_holding(self._captured, num_seqs, table_width)

    def warm_buckets(self) -> list[tuple[int, int]]:
        """The buckets the warm-up captures (``warm_buckets`` of this table's rows and
        widths)."""
        return warm_buckets(self.rows, self.widths)

    def seal(self) -> None:
        """From now on ``bucket`` chooses among the captured buckets only."""
        self._captured = sorted(self._buckets)
        self.sealed = True

    def run(self, key: tuple[int, int], host_inputs) -> Array:
        """Replay bucket ``key`` on ``host_inputs`` (packed for that bucket's layout); returns the
        graph's logits buffer (all padded rows; valid until the next replay of this bucket)."""
        bucket = self._buckets.get(key) or self.capture(*key)
        bucket.inputs.set(host_inputs)
        self.num_replays += 1
        return bucket.graph.replay()

    def capture(self, rows: int, width: int) -> _Bucket:
        """Capture bucket (``rows``, ``width``) now (idempotent; rows and width from
        ``self.rows`` / ``self.widths``)."""
        if (rows, width) not in self._buckets:
            layout = StepLayout(rows, rows, width)
            self._buckets[(rows, width)] = _Bucket(self.ops, self.model, self.kv_cache, layout)
            self.num_captures += 1
        return self._buckets[(rows, width)]
