"""Prompt logprobs (vLLM's ``prompt_logprobs``): every prompt token after the first scored from
the logits of the position before it, whatever the chunking, cache or batch.

The reference is HF transformers' forward of the same checkpoint (float32); the engine's own
one-chunk result is the reference for chunked prefill, preemption and batching.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_helpers import HFCheckpoint, random_prompts

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from engine.step_inputs import pack_step


def _scored(num_top: int = 3, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 2), ignore_eos=True,
                          prompt_logprobs=num_top, **kw)


def _logprobs(entries: list) -> list[float]:
    return [e.logprob for e in entries[1:]]


def test_prompt_logprobs_are_the_log_softmax_of_the_model_logits(qwen3: HFCheckpoint) -> None:
    pytest.importorskip("torch")
    prompt = random_prompts(4000, [21], seed=41)[0]
    with LLM(str(qwen3.path), device="cpu") as llm:
        out = llm.generate([prompt], _scored(4))[0]
    reference = qwen3.logits(prompt).astype(np.float64)  # [T, V]: row p predicts token p + 1
    reference -= reference.max(axis=-1, keepdims=True)
    reference -= np.log(np.exp(reference).sum(axis=-1, keepdims=True))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(out.prompt_logprobs[1:]):
        row, token_id = reference[position], prompt[position + 1]
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(row[token_id], abs=1e-3)
        # its place among the tokens at least as likely, up to the float32 error of the two
        assert int(np.count_nonzero(row > row[token_id] + 1e-3)) + 1 <= entry.rank \
            <= int(np.count_nonzero(row >= row[token_id] - 1e-3))
        top_ids = [i for i, _ in entry.top]
        assert top_ids == np.argsort(-row, kind="stable")[:4].tolist()
        np.testing.assert_allclose([lp for _, lp in entry.top], row[top_ids], atol=1e-3)


def test_chunks_preemption_and_neighbours_change_nothing(tiny_model_dir: Path) -> None:
    # 300 tokens in one chunk: scored over more than one host pass (PROMPT_LOGPROB_ROWS_PER_PASS)
    prompts = random_prompts(4000, [300, 45, 70], seed=42)
    with LLM(str(tiny_model_dir), device="cpu") as llm:
        alone = [llm.generate([p], _scored(2, max_tokens=40))[0] for p in prompts]
        plain = llm.generate([prompts[1]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    # 7-token chunks; 22 blocks of 16 hold the long one but not all three: one is preempted
    with LLM(str(tiny_model_dir), device="cpu", max_num_batched_tokens=7,
             num_kv_blocks=22) as llm:
        params = [_scored(2, max_tokens=40), SamplingParams(max_tokens=40, ignore_eos=True),
                  _scored(2, max_tokens=40)]
        outs = llm.generate(prompts, params)
        assert llm.engine.stats()["num_preemptions"] > 0
    for i in (0, 2):
        got, want = outs[i], alone[i]
        assert got.prompt_logprobs[0] is None
        assert [e.token_id for e in got.prompt_logprobs[1:]] == prompts[i][1:]
        np.testing.assert_allclose(_logprobs(got.prompt_logprobs),
                                   _logprobs(want.prompt_logprobs), atol=1e-5)
        for got_entry, want_entry in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert [t for t, _ in got_entry.top] == [t for t, _ in want_entry.top]
            assert abs(got_entry.rank - want_entry.rank) <= 1  # a near-tie may swap
        assert got.token_ids == want.token_ids
    assert outs[1].prompt_logprobs is None and outs[1].token_ids == plain.token_ids


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_model_dir: Path) -> None:
    prompt = random_prompts(4000, [50], seed=43)[0]
    with LLM(str(tiny_model_dir), device="cpu") as llm:
        cold = llm.generate([prompt], _scored())[0]
        warm_plain = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0]
        assert warm_plain.num_cached_tokens == 48  # the scored request cached its blocks
        scored = llm.generate([prompt], _scored())[0]
        assert scored.num_cached_tokens == 0
        np.testing.assert_allclose(_logprobs(scored.prompt_logprobs),
                                   _logprobs(cold.prompt_logprobs), atol=1e-6)
        one_token = llm.generate([prompt[:1]], _scored())[0]
        assert one_token.prompt_logprobs == [None]


def test_only_scored_chunks_add_logits_rows() -> None:
    def seq(params: SamplingParams, computed: int) -> Sequence:
        return Sequence("r", list(range(10, 20)), params, b"", np.random.default_rng(0), None,
                        block_ids=[0, 1, 2], num_computed_tokens=computed)

    scored, plain = seq(_scored(1), 4), seq(SamplingParams(), 0)
    scored.prompt_logprobs.extend([None] * 4)  # positions 0..3 scored tokens 1..4 already
    host, layout, sampling = pack_step([plain, scored], [10, 6], block_size=4)
    assert sampling == [plain, scored] and layout.num_prompt_rows == 5  # positions 4..8
    # rows: plain's 10 then scored's 6 (positions 4..9); position 9 samples
    assert layout.views(host)["logits_indices"].tolist() == [9, 15, 10, 11, 12, 13, 14]
    _, layout, _ = pack_step([plain], [10], block_size=4)
    assert layout.num_prompt_rows == 0


@pytest.mark.parametrize("value", [21, -1, True, 2.0])
def test_prompt_logprobs_are_bounded(value: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


@pytest.mark.gpu
def test_prompt_logprobs_on_the_gpu_match_the_cpu(tiny_model_dir: Path) -> None:
    """The GPU path (CuPy logits rows, eager steps for scored chunks) against the CPU's."""
    prompts = random_prompts(4000, [300, 45], seed=43)
    params = [_scored(3, max_tokens=8), SamplingParams(max_tokens=8, ignore_eos=True)]
    with LLM(str(tiny_model_dir), device="cpu") as llm:
        want = llm.generate(prompts, params)
    with LLM(str(tiny_model_dir), device="cuda", max_num_batched_tokens=128) as llm:
        got = llm.generate(prompts, params)
    assert got[1].prompt_logprobs is None
    assert got[0].prompt_logprobs[0] is None
    assert len(got[0].prompt_logprobs) == len(prompts[0])
    for g, w in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:], strict=True):
        assert g.token_id == w.token_id
        assert g.logprob == pytest.approx(w.logprob, abs=0.05)  # bf16 on the GPU
