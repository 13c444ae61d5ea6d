"""Long prefill chunks warmed up before ready: a cold prompt's chunks run eagerly, and their
attention plans (cuDNN graphs, one per rows and table-width bucket) would otherwise be built,
or loaded from the disk cache, on the first request of each shape. After the seal a missing
plan is built by the background builder while our slower kernel serves the shape: on a fresh
machine the first agent's first turn took 191 ms against 127 ms for the same turn once the
plans existed (H200, Qwen3-4B shape, 2026-11-29). The warm-up runs the first layer's prefill
attention once per bucket, on zero queries (no KV written, no sequence touched, about a
millisecond each instead of a whole forward), so those plans are ready, or loaded, before
``/ready``.
"""

from __future__ import annotations

from engine.models.decoder import DecoderModel, ForwardBatch
from engine.step_inputs import StepLayout
from kernels.ops import Array, Ops

# Chunks of this many rows or fewer run as captured prefill graphs, or on the split kernel over
# long contexts: the warm-up starts above them.
LONG_PREFILL_MIN_ROWS = 512
# Prompts whose chunks share one step's budget, warmed up to this many (as prefill graphs are).
MAX_SEQS_SHARING_A_CHUNK = 4


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def long_prefill_shapes(chunk_tokens: int, max_table_width: int, block_size: int
                        ) -> list[tuple[int, int, int]]:
    """(sequences, rows, table width) of the idle prefills a warm-up runs: one sequence with
    a full chunk and with each power of two below it down to ``LONG_PREFILL_MIN_ROWS``, two to
    ``MAX_SEQS_SHARING_A_CHUNK`` sequences sharing a full chunk; each at every power-of-two
    table width from the rows' own up to the longest context's (the attention buckets chunked
    cold prompts go through)."""
    if chunk_tokens < 1 or max_table_width < 1 or block_size < 1:
        raise ValueError("chunk_tokens, max_table_width and block_size must be positive")
    rows_list, rows = [chunk_tokens], _pow2(chunk_tokens) // 2
    while rows >= LONG_PREFILL_MIN_ROWS:
        rows_list.append(rows)
        rows //= 2
    shapes = []
    several = [(n, chunk_tokens) for n in range(2, MAX_SEQS_SHARING_A_CHUNK + 1)]
    for num_seqs, rows in [(1, r) for r in rows_list] + several:
        if rows <= LONG_PREFILL_MIN_ROWS // 2 or rows < 2 * num_seqs:
            continue
        width = _pow2(-(-rows // (num_seqs * block_size)))
        while width <= _pow2(max_table_width):
            table = min(width, max_table_width)
            if table * block_size >= -(-rows // num_seqs):  # each context holds its rows
                shapes.append((num_seqs, rows, table))
            width *= 2
    return list(dict.fromkeys(shapes))


def run_idle_prefill(ops: Ops, model: DecoderModel, kv_cache: Array, block_size: int,
                     num_seqs: int, rows: int, width: int) -> None:
    """The attention of one eager prefill of ``num_seqs`` sequences sharing ``rows`` new
    tokens over contexts that fill a ``width``-block table of block 0: the plans and kernels
    such a step's attention uses are built or loaded (the rest of a forward has none to
    build); no KV is written and the output is dropped (read back once, so the work has
    finished when this returns)."""
    xp = ops.xp
    layout = StepLayout(rows, num_seqs, width)
    views = layout.views(xp.zeros(layout.bounds[-1], dtype="int32"))
    ends = [(b + 1) * rows // num_seqs for b in range(num_seqs)]
    context = width * block_size
    views["slot_mapping"][:] = -1
    views["cu_seqlens_q"][1:] = xp.asarray(ends, dtype="int32")
    views["context_lens"][:] = context
    views["logits_indices"][:] = xp.asarray([e - 1 for e in ends], dtype="int32")
    max_query = max(e - s for s, e in zip([0] + ends[:-1], ends))
    batch = ForwardBatch(is_decode=False, max_query_len=max_query, max_context_len=context,
                         **views)
    ops.to_host(model.prefill_attention(batch, kv_cache)[:1, :1, :1])
