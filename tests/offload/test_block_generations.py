"""Block generations: a block published as resident is never written under the same generation.

The HBM tier's safety rests on this block-manager invariant (the daemon checks a block's generation
before and after copying it): whatever the scheduler does, every write into a block happens after
the block's generation moved past the value it had when the block was last published.
"""

from __future__ import annotations

import random

from block_simulation import Simulation, make_seq
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from offload.block_generations import BlockGenerations


class PublishingSimulation(Simulation):
    """The random driver, publishing as the offload manager does after each operation."""

    def __init__(self, bm: BlockManager, rng: random.Random, gens: BlockGenerations) -> None:
        super().__init__(bm, rng)
        self.gens = gens
        self.published: dict[int, int] = {}  # block id -> generation it was published with
        self.num_published = 0

    def compute(self, seq, num_new: int) -> None:
        bs = self.bm.block_size
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = seq.block_ids[pos // bs]
            assert self.published.get(block) != self.gens.get(block), \
                f"block {block} written under its published generation"
        super().compute(seq, num_new)

    def publish(self) -> None:
        for block, cached in self.bm.drain_resident():
            assert self.bm._cached[block] is cached
            self.published[block] = self.gens.get(block)
            self.num_published += 1


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), num_blocks=st.integers(1, 16),
       block_size=st.sampled_from([1, 4]))
def test_published_blocks_change_only_under_a_new_generation(seed: int, num_blocks: int,
                                                              block_size: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    gens = BlockGenerations(num_blocks)
    try:
        bm.enable_offload(track_released=False, generations=gens)
        sim = PublishingSimulation(bm, rng, gens)
        for i in range(150):
            action = rng.random()
            if action < 0.35 or not sim.live:
                sim.admit(i)
            elif action < 0.8:
                sim.step(rng.choice(sim.live))
            elif action < 0.95:
                sim.finish(rng.choice(sim.live))
            else:
                bm.reset_prefix_cache()
            sim.publish()
            sim.check()
    finally:
        gens.close()


def test_allocation_bumps_and_eviction_hides_a_registration() -> None:
    bm = BlockManager(2, 4)
    gens = BlockGenerations(2)
    try:
        bm.enable_offload(track_released=False, generations=gens)
        a = make_seq("a", list(range(5)))
        assert bm.admit(a, [], 5)
        assert [gens.get(b) for b in range(2)] == [1, 1]
        a.num_computed_tokens = 5
        bm.register_computed_blocks(a)
        bm.free(a)
        # Registered and evicted before anyone drained it: not published.
        b = make_seq("b", [9] * 8)
        assert bm.admit(b, [], 8)
        assert sorted(gens.get(x) for x in range(2)) == [2, 2]
        assert bm.drain_resident() == []
        b.num_computed_tokens = 8
        bm.register_computed_blocks(b)
        assert [block for block, _ in bm.drain_resident()] == b.block_ids
        assert bm.drain_resident() == []
        assert sorted(block for block, _ in bm.cached_items()) == sorted(b.block_ids)
    finally:
        gens.close()
