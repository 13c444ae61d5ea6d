"""The GPU copy pipeline's chunking (CPU): every block of a request lands in exactly one chunk."""

from __future__ import annotations

import pytest

from kvstore.engines.copy_pipeline import chunk_spans
from kvstore.engines.copy_settings import CopySettings

BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 3, 31, 64, 1024])
@pytest.mark.parametrize("chunk_bytes", [0, 1, BLOCK_BYTES, 32 << 20, 128 << 20])
@pytest.mark.parametrize("growth", [2, 4])
def test_chunks_cover_the_request_in_order_and_grow_to_the_limit(num_blocks: int,
                                                                 chunk_bytes: int,
                                                                 growth: int) -> None:
    spans = list(chunk_spans(num_blocks, BLOCK_BYTES, chunk_bytes, growth))
    assert [i for span in spans for i in span] == list(range(num_blocks))
    if chunk_bytes <= 0:
        assert len(spans) == 1  # one submission for the whole request
        return
    most = max(1, chunk_bytes // BLOCK_BYTES)
    sizes = [len(s) for s in spans]
    assert all(0 < size <= most for size in sizes)
    assert sizes[:-1] == sorted(sizes[:-1])  # small first chunk, then growing
    if num_blocks >= 1024 and most > growth:
        assert sizes[0] == growth and most in sizes
        assert all(b <= a * growth for a, b in zip(sizes, sizes[1:]))


def test_a_load_of_64_blocks_goes_in_three_chunks_a_save_in_seven() -> None:
    """The shipped settings on kvengine's 2.36 MB blocks: a load's first chunk copies while
    the next (four times larger) is submitted; a save's chunks double, each block reserving a
    slot while the previous chunk copies."""
    settings = CopySettings()
    load = chunk_spans(64, BLOCK_BYTES, settings.load_chunk_bytes, settings.load_growth)
    save = chunk_spans(64, BLOCK_BYTES, settings.chunk_bytes)
    assert [len(s) for s in load] == [4, 16, 44]
    assert [len(s) for s in save] == [2, 4, 8, 14, 14, 14, 8]
