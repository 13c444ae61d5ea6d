"""LogitsProcessor's per-sequence arrays: reused across steps, the adjusted logits equal what a
processor that starts afresh at every step computes."""

from __future__ import annotations

import gc

import numpy as np

from engine import SamplingParams
from engine.logits_processor import LogitsProcessor
from engine.sequence import Sequence
from kernels import make_ops

VOCAB = 300


def _seq(params: SamplingParams, prompt: list[int]) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=prompt, params=params,
                    namespace_digest=b"", generator=np.random.default_rng(0), detokenizer=None,
                    token_ids=list(prompt))


def test_steps_with_the_cache_equal_a_fresh_processor_each_step() -> None:
    ops = make_ops("cpu")
    rng = np.random.default_rng(7)
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3,
                            logit_bias={3: 2.0, 299: -5.0, 7: 0.5})
    other = SamplingParams(repetition_penalty=0.7)
    a = _seq(params, [int(t) for t in rng.integers(0, VOCAB, 50)])
    b = _seq(other, [1, 2, 3])
    cached = LogitsProcessor(ops, [0])
    for step in range(12):
        logits = rng.normal(0, 2, (2, VOCAB)).astype(np.float32)
        got = cached(logits, [a, b])
        want = LogitsProcessor(ops, [0])(logits, [a, b])
        np.testing.assert_array_equal(got, want)
        # a new token each step: sometimes one seen before, sometimes a new id
        a.token_ids.append(int(a.token_ids[step]) if step % 2 else 250 + step)
        b.token_ids.append(40 + step)


def test_a_sequence_gone_leaves_nothing_behind() -> None:
    processor = LogitsProcessor(make_ops("cpu"), [0])
    seq = _seq(SamplingParams(repetition_penalty=1.2, logit_bias={5: 1.0}), [4, 5, 6])
    processor(np.zeros((1, VOCAB), np.float32), [seq])
    assert len(processor._rows) == 1
    del seq
    gc.collect()
    assert len(processor._rows) == 0
