"""Which CUDA graphs the warm-up captures and which one a step replays after it (pure functions
of engine/decode_graphs.py and engine/prefill_graphs.py; the GPU test runs them for real)."""

from __future__ import annotations

import itertools

import pytest

from engine import decode_graphs, prefill_graphs
from engine.decode_graphs import row_buckets, smallest_holding, width_buckets


@pytest.mark.parametrize("max_rows,max_width", [(256, 2560), (16, 777), (8, 256), (4, 128),
                                                (1, 16), (32, 16), (48, 1000)])
def test_every_step_after_the_warm_up_has_a_captured_graph(max_rows, max_width) -> None:
    rows, widths = row_buckets(max_rows), width_buckets(max_width)
    captured = sorted(decode_graphs.warm_buckets(rows, widths))
    assert len(set(captured)) == len(captured)
    assert all(r in rows and w in widths for r, w in captured)
    assert (max_rows, max_width) in captured  # the largest step fits
    for num_seqs, width in itertools.product(range(1, max_rows + 1), range(1, max_width + 1)):
        rows_, width_ = smallest_holding(captured, num_seqs, width)
        assert rows_ >= num_seqs and width_ >= width
        if num_seqs == 1:  # one sequence never pads its table
            assert width_ == widths[next(i for i, w in enumerate(widths) if w >= width)]
        else:  # a batch pads its table to at most 4x, or to the smallest warm width
            assert width_ <= max(4 * width, 64, widths[0]) or width_ == max_width


def test_the_ladder_is_sparse() -> None:
    captured = decode_graphs.warm_buckets(row_buckets(256), width_buckets(2560))
    assert len(captured) == 21  # 9 widths of one row, 4 widths of 16, 64 and 256 rows
    assert {r for r, _ in captured} == {1, 16, 64, 256}


def test_nothing_holds_a_step_past_the_largest_graph() -> None:
    captured = sorted(decode_graphs.warm_buckets(row_buckets(16), width_buckets(128)))
    assert smallest_holding(captured, 17, 10) is None
    assert smallest_holding(captured, 3, 129) is None
    assert smallest_holding(captured, 3, 20) == (16, 128)  # batches from 64 blocks: 128 here


def test_short_prefills_warm_one_sequence_at_every_size_several_at_the_largest() -> None:
    tokens = prefill_graphs.token_buckets()
    captured = prefill_graphs.warm_buckets(tokens)
    assert [(1, t) for t in tokens] == captured[:len(tokens)]
    assert captured[len(tokens):] == [(s, 256) for s in range(2, prefill_graphs.MAX_SEQS + 1)]


def test_prefill_buckets_past_256_tokens_grow_by_256() -> None:
    assert prefill_graphs.token_buckets(256) == [16, 32, 64, 128, 256]
    assert prefill_graphs.token_buckets(100) == [16, 32, 64, 128]
    assert prefill_graphs.token_buckets(700) == [16, 32, 64, 128, 256, 512, 768]
    tokens = prefill_graphs.token_buckets(1024)
    captured = prefill_graphs.warm_buckets(tokens)
    assert (1, 1024) in captured and (2, 1024) not in captured and (4, 256) in captured
    with pytest.raises(ValueError, match="at least 16"):
        prefill_graphs.token_buckets(8)
