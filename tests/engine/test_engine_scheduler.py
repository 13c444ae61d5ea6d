"""Scheduler invariants under random workloads: budget, max_num_seqs, blocks, order, progress."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.prefill_order import PrefillOrder
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make_seq(request_id: str, num_tokens: int, rng: random.Random) -> Sequence:
    return Sequence(request_id=request_id,
                    prompt_token_ids=[rng.randrange(20) for _ in range(num_tokens)],
                    params=SamplingParams(), namespace_digest=bytes(16),
                    generator=np.random.default_rng(0), detokenizer=None)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), block_size=st.sampled_from([1, 2, 4]),
       max_num_seqs=st.integers(1, 5), budget=st.integers(1, 24),
       policy=st.sampled_from(["shortest-first", "fcfs"]), max_wait=st.integers(0, 4),
       cap=st.sampled_from([None, 1, 3, 8]), spread_arrivals=st.booleans())
def test_scheduler_invariants(seed: int, block_size: int, max_num_seqs: int, budget: int,
                              policy: str, max_wait: int, cap: int | None,
                              spread_arrivals: bool) -> None:
    """Budget, max_num_seqs, blocks, first-come-first-admitted and progress, under random
    workloads with preemption, for every prefill order, with every request there at once or
    arriving over the first steps."""
    rng = random.Random(seed)
    max_len = 24
    num_blocks = -(-max_len // block_size) + rng.randrange(0, 8)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs, budget, PrefillOrder(policy, max_wait, cap))
    seqs = [make_seq(f"r{i}", rng.randrange(1, 16), rng) for i in range(10)]
    wants = {s.request_id: rng.randrange(1, max_len - s.num_prompt_tokens + 1) for s in seqs}
    arrivals = [[s] for s in seqs] if spread_arrivals else [seqs]
    admitted: list[str] = []
    for step in range(2000):
        if step < len(arrivals):
            for s in arrivals[step]:
                sched.add(s)
        elif not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch.num_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status is SequenceStatus.RUNNING and n >= 1
            assert seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_ids) * block_size >= seq.num_computed_tokens + n
            if seq.request_id not in admitted:
                admitted.append(seq.request_id)
        sched.advance(batch)
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:  # it sampled a token
                seq.token_ids.append(rng.randrange(20))
                if seq.num_output_tokens >= wants[seq.request_id]:
                    sched.finish(seq, "length")
        bm.check_integrity()
    assert not sched.has_unfinished(), "the workload did not finish: no progress"
    assert admitted == [s.request_id for s in seqs]  # first come, first admitted
    assert bm.num_used_blocks == 0
