"""The packed step metadata (one host-to-device copy per step) and the decode-graph buckets."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decode_graphs import DecodeGraphs, row_buckets, width_buckets
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_inputs import StepLayout, pack_step
from kernels import make_ops


def _seq(token_ids: list[int], block_ids: list[int], computed: int) -> Sequence:
    return Sequence("r", token_ids, SamplingParams(), b"", np.random.default_rng(0), None,
                    block_ids=block_ids, num_computed_tokens=computed)


def test_packs_a_mixed_batch_exactly() -> None:
    a = _seq(list(range(10, 16)), [7, 3], 0)  # a 6-token prompt in 4-token blocks
    b = _seq(list(range(20, 29)), [5, 1, 9], 8)  # decoding its 9th token
    host, layout, sampling = pack_step([a, b], [6, 1], block_size=4)
    f = layout.views(host)
    assert layout == StepLayout(num_tokens=7, num_seqs=2, table_width=3)
    assert f["token_ids"].tolist() == [10, 11, 12, 13, 14, 15, 28]
    assert f["positions"].tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert f["slot_mapping"].tolist() == [28, 29, 30, 31, 12, 13, 36]
    assert f["block_tables"].tolist() == [[7, 3, 0], [5, 1, 9]]
    assert f["cu_seqlens_q"].tolist() == [0, 6, 7]
    assert f["context_lens"].tolist() == [6, 9]
    assert f["logits_indices"].tolist() == [5, 6]
    assert sampling == [a, b]


def test_padded_decode_rows_are_idle_and_in_bounds() -> None:
    seqs = [_seq([1, 2, 3], [4], 2), _seq([5, 6, 7, 8, 9], [2, 6], 4)]
    host, layout, sampling = pack_step(seqs, [1, 1], block_size=4, num_rows=4, table_width=8)
    f = layout.views(host)
    assert layout == StepLayout(num_tokens=4, num_seqs=4, table_width=8)
    assert f["slot_mapping"].tolist() == [18, 24, -1, -1]  # padding writes no KV
    assert f["context_lens"].tolist() == [3, 5, 1, 1]
    assert f["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4]
    assert f["logits_indices"].tolist() == [0, 1, 2, 3]
    assert f["block_tables"][1].tolist() == [2, 6, 0, 0, 0, 0, 0, 0]
    assert not f["block_tables"][2:].any()
    assert sampling == seqs


def test_padding_refuses_what_does_not_fit() -> None:
    seqs = [_seq([1, 2, 3], [4], 2), _seq(list(range(9)), [1, 2, 3], 8)]
    with pytest.raises(ValueError, match="at most that many"):
        pack_step(seqs, [1, 1], 4, num_rows=1, table_width=8)
    with pytest.raises(ValueError, match="the table has 2"):
        pack_step(seqs, [1, 1], 4, num_rows=2, table_width=2)
    prompt = _seq([1, 2, 3], [4], 0)
    with pytest.raises(ValueError, match="decode batch"):
        pack_step([prompt], [3], 4, num_rows=4, table_width=8)


def test_buckets_cover_every_size_once() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(256)[:9] == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert row_buckets(256)[-1] == 256 and row_buckets(100)[-1] == 100
    assert row_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert width_buckets(2560) == [16, 32, 64, 128, 256, 512, 1024, 2048, 2560]
    assert width_buckets(8) == [8]
    for max_rows in (1, 7, 20, 256):
        sizes = row_buckets(max_rows)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_rows


def test_graphs_need_a_backend_that_captures() -> None:
    with pytest.raises(ValueError, match="no graphs"):
        DecodeGraphs(make_ops("cpu"), model=None, kv_cache=np.zeros(1), max_rows=4,
                     max_table_width=16)
    with pytest.raises(NotImplementedError):
        make_ops("cpu").capture_graph(lambda: None)


def test_padded_prefill_rows_follow_the_last_sequence() -> None:
    from engine.step_inputs import pack_prefill

    a = _seq(list(range(10, 19)), [7, 3, 5], 6)  # 3 new tokens over 6 cached (4-token blocks)
    b = _seq(list(range(20, 25)), [2, 6], 0)  # a 5-token prompt
    host, layout, sampling = pack_prefill([a, b], [3, 5], 4, num_tokens=16, table_width=8)
    f = layout.views(host)
    assert layout == StepLayout(num_tokens=16, num_seqs=2, table_width=8)
    assert f["token_ids"].tolist() == [16, 17, 18, 20, 21, 22, 23, 24] + [0] * 8
    assert f["positions"].tolist() == [6, 7, 8, 0, 1, 2, 3, 4] + [0] * 8
    assert f["slot_mapping"].tolist() == [14, 15, 20, 8, 9, 10, 11, 24] + [-1] * 8
    assert f["cu_seqlens_q"].tolist() == [0, 3, 16]  # the padding joins the last sequence
    assert f["context_lens"].tolist() == [9, 5 + 8]  # and extends its context past its rows
    assert f["logits_indices"].tolist() == [2, 7]  # real rows sample
    assert sampling == [a, b]
    with pytest.raises(ValueError, match="do not fit"):
        pack_prefill([a, b], [3, 5], 4, num_tokens=4, table_width=8)
    with pytest.raises(ValueError, match="table"):
        pack_prefill([a, b], [3, 5], 4, num_tokens=64, table_width=8)
    with pytest.raises(ValueError, match="sample every"):
        pack_prefill([b], [3], 4, num_tokens=16, table_width=8)


def test_padded_prefill_gives_the_real_rows_their_exact_logits(tiny_model_dir) -> None:
    """The model on CPU: a turn over a cached prefix, packed exactly and padded to a graph
    bucket, gives the same logits, and the padding writes no KV."""
    from engine import EngineConfig, LLMEngine
    from engine.models.decoder import ForwardBatch
    from engine.step_inputs import pack_prefill

    with LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=64,
                                block_size=4)) as engine:
        runner = engine.runner
        rng = np.random.default_rng(5)
        tokens = rng.integers(3, engine.vocab_size, 30).tolist()
        cached = _seq(tokens[:27], list(range(1, 8)), 0)
        host, layout, _ = pack_step([cached], [27], 4)
        runner.forward(ForwardBatch(is_decode=False, **layout.views(host)))
        turn = _seq(tokens, list(range(1, 9)), 27)
        other = _seq(tokens[:5], [20, 21], 0)
        arena = runner.kv_cache.array
        results = []
        for pad in (False, True):
            before = arena.copy()
            if pad:
                host, layout, _ = pack_prefill([other, turn], [5, 3], 4, 32, 24)
            else:
                host, layout, _ = pack_step([other, turn], [5, 3], 4)
            views = layout.views(host)
            results.append(runner.forward(ForwardBatch(is_decode=False, **views)))
            written = np.argwhere((arena != before).any(axis=(1, 2, 3, 4, 5)))[:, 0]
            assert set(written.tolist()) <= {7, 8, 20, 21}  # only the real rows' blocks
        np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
