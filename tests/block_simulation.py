"""A random driver of the block manager, shared by the block-manager and block-generation tests."""

from __future__ import annotations

import random

import numpy as np

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

NAMESPACE = bytes(16)


def make_seq(request_id: str, token_ids: list[int], namespace: bytes = NAMESPACE) -> Sequence:
    return Sequence(request_id=request_id, prompt_token_ids=list(token_ids),
                    params=SamplingParams(), namespace_digest=namespace,
                    generator=np.random.default_rng(0), detokenizer=None)


class Simulation:
    """Drives a block manager the way the scheduler does and keeps a shadow of what each block
    holds (token ids written at each slot), to check that every hit serves the right content."""

    def __init__(self, bm: BlockManager, rng: random.Random) -> None:
        self.bm = bm
        self.rng = rng
        self.live: list[Sequence] = []
        self.content: dict[int, dict[int, int]] = {}
        self.prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
        self.num_hit_tokens = 0

    def compute(self, seq: Sequence, num_new: int) -> None:
        bs = self.bm.block_size
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = seq.block_ids[pos // bs]
            self.content.setdefault(block, {})[pos % bs] = seq.token_ids[pos]
        seq.num_computed_tokens += num_new
        self.bm.register_computed_blocks(seq)

    def admit(self, index: int) -> None:
        base = self.rng.choice(self.prefixes)
        tokens = base[: self.rng.randrange(1, 40)] + [self.rng.randrange(50)
                                                      for _ in range(self.rng.randrange(0, 9))]
        seq = make_seq(f"r{index}", tokens)
        hits = self.bm.match_prefix(seq)
        bs = self.bm.block_size
        for j, block in enumerate(hits):  # the cached content is exactly our tokens
            assert [self.content[block][o] for o in range(bs)] == tokens[j * bs:(j + 1) * bs]
        num_new = self.rng.randrange(1, seq.num_tokens - len(hits) * bs + 1)
        if self.bm.admit(seq, hits, num_new):
            self.num_hit_tokens += len(hits) * bs
            assert seq.num_computed_tokens == len(hits) * bs
            self.live.append(seq)
            self.compute(seq, num_new)

    def step(self, seq: Sequence) -> None:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(self.rng.randrange(50))  # a sampled token
        num_new = self.rng.randrange(1, seq.num_tokens - seq.num_computed_tokens + 1)
        if self.bm.grow(seq, seq.num_computed_tokens + num_new):
            self.compute(seq, num_new)
        else:
            self.finish(seq)  # a preemption, from the block manager's point of view

    def finish(self, seq: Sequence) -> None:
        self.live.remove(seq)
        self.bm.free(seq)
        assert seq.block_ids == []

    def check(self) -> None:
        self.bm.check_integrity()
        refs = [0] * self.bm.num_blocks
        for seq in self.live:
            assert len(seq.block_ids) * self.bm.block_size >= seq.num_computed_tokens
            for block in seq.block_ids:
                refs[block] += 1
        assert refs == self.bm._ref_counts
        assert self.bm.num_used_blocks == sum(1 for r in refs if r > 0)
