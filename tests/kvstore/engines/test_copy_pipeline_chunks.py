"""The GPU copy pipeline's chunking (CPU): every block of a request lands in exactly one chunk."""

from __future__ import annotations

import pytest

from kvstore.engines.copy_pipeline import chunk_spans

BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 3, 31, 64, 1024])
@pytest.mark.parametrize("chunk_bytes", [0, 1, BLOCK_BYTES, 32 << 20])
def test_chunks_cover_the_request_in_order_and_grow_to_the_limit(num_blocks: int,
                                                                 chunk_bytes: int) -> None:
    spans = list(chunk_spans(num_blocks, BLOCK_BYTES, chunk_bytes))
    assert [i for span in spans for i in span] == list(range(num_blocks))
    if chunk_bytes <= 0:
        assert len(spans) == 1  # one submission for the whole request
        return
    most = max(1, chunk_bytes // BLOCK_BYTES)
    sizes = [len(s) for s in spans]
    assert all(0 < size <= most for size in sizes)
    assert sizes[:-1] == sorted(sizes[:-1])  # small first chunk, then growing
    if num_blocks >= 64 and most > 2:
        assert sizes[0] == 2 and most in sizes
