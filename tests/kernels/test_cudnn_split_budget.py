"""The split prefill's scratch bound (kernels/cudnn_split.py), on CPU: its q_rep / o_part grow
with every sequence of the step times its slices, so a mixed batch of many decode rows beside
one short turn must run as one paged call, while the prefill graphs' buckets keep the split."""

from __future__ import annotations

from engine.prefill_graphs import MAX_SEQS, token_buckets
from kernels.cudnn_split import MAX_SCRATCH_BYTES, scratch_bytes, slice_count

QWEN3_4B_HEADS = (32, 128)  # query heads, head dim
# kernels/cudnn_attention._SPLIT_MAX_ROWS (that module needs the GPU packages): larger buckets
# take the dense path, not the split
SPLIT_MAX_ROWS = 256


def test_many_decode_rows_beside_a_short_turn_do_not_split() -> None:
    """255 decode rows and a 40-token turn over 16k contexts (1,024 16-token blocks): ~2.4 GB
    of scratch with the split, none with one paged call."""
    num_slices = slice_count(1024, 16)
    assert num_slices == 8
    needed = scratch_bytes(256, num_slices, 64, *QWEN3_4B_HEADS)
    assert needed > 2 << 30
    assert needed > MAX_SCRATCH_BYTES


def test_prefill_graph_buckets_keep_the_split() -> None:
    """The largest prefill graph bucket that splits, at a 40,960-token model length: its table
    (2,560 blocks plus the padding's, rounded up to 4,096) gives 16 slices, within the bound."""
    num_slices = slice_count(4096, 16)
    assert num_slices == 16
    rows = max(t for t in token_buckets() if t <= SPLIT_MAX_ROWS)
    assert rows == SPLIT_MAX_ROWS
    assert scratch_bytes(MAX_SEQS, num_slices, rows, *QWEN3_4B_HEADS) <= MAX_SCRATCH_BYTES
    assert scratch_bytes(1, num_slices, 64, *QWEN3_4B_HEADS) <= MAX_SCRATCH_BYTES
