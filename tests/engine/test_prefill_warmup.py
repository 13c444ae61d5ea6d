"""The warm-up's idle long prefills (engine/prefill_warmup.py): which attention buckets they
cover, and that running one writes no KV and leaves the engine's answers unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.prefill_warmup import LONG_PREFILL_MIN_ROWS, long_prefill_shapes, run_idle_prefill


def test_a_qwen3_4b_servers_chunks_cover_every_bucket_of_a_long_cold_prompt() -> None:
    # 2,048-token chunks, 16-token blocks, contexts up to 12,432 tokens (777 blocks)
    shapes = long_prefill_shapes(2048, 777, 16)
    assert (1, 2048, 128) in shapes and (1, 2048, 777) in shapes  # first and last full chunk
    assert {(1, 1024, w) for w in (64, 128, 256, 512, 777)} <= set(shapes)
    assert {(1, 512, w) for w in (32, 64, 128, 256, 512, 777)} <= set(shapes)
    assert (2, 2048, 64) in shapes and (4, 2048, 32) in shapes  # prompts sharing a chunk
    assert all(rows >= LONG_PREFILL_MIN_ROWS for _, rows, _ in shapes)
    assert len(shapes) == len(set(shapes)) == 4 + 5 + 6 + 5 + 5 + 6
    # every context holds its rows, and no table is wider than the longest context's
    assert all(w * 16 >= rows / seqs and w <= 777 for seqs, rows, w in shapes)


def test_short_contexts_and_chunks_leave_out_what_cannot_occur() -> None:
    assert long_prefill_shapes(256, 1000, 16) == []  # short chunks replay graphs
    # max_model_len 1,024 (64 blocks): a 2,048-token chunk never fits one sequence's context
    assert all(seqs > 1 or rows <= 1024 for seqs, rows, _ in long_prefill_shapes(2048, 64, 16))
    with pytest.raises(ValueError):
        long_prefill_shapes(0, 64, 16)


def test_an_idle_prefill_writes_no_kv_and_changes_no_answer(tiny_model_dir) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = list(range(3, 700))
    with LLM(str(tiny_model_dir), device="cpu", max_num_seqs=4, max_model_len=2048) as llm:
        before = llm.generate([prompt], params)[0].token_ids
        runner = llm.engine.runner
        arena = runner.kv_cache.array
        saved = np.array(arena, copy=True)
        for num_seqs, rows, width in long_prefill_shapes(1024, 128, runner.block_size):
            run_idle_prefill(runner.ops, runner.model, arena, runner.block_size, num_seqs, rows,
                             width)
        assert np.array_equal(np.asarray(arena), saved)
        again = llm.generate([prompt + [1]], params)[0]  # its prefix an HBM hit
        assert again.num_cached_tokens > 0
        fresh = llm.generate([prompt], params)[0].token_ids
    assert fresh == before
