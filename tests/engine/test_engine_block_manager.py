"""Block manager: integrity under random operations, verified hits, LRU eviction."""

from __future__ import annotations

import random

import pytest
from block_simulation import Simulation, make_seq
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), num_blocks=st.integers(1, 24),
       block_size=st.sampled_from([1, 4, 8]), debug_hash_bits=st.sampled_from([None, 3]))
def test_integrity_under_random_operations(seed: int, num_blocks: int, block_size: int,
                                           debug_hash_bits: int | None) -> None:
    rng = random.Random(seed)
    sim = Simulation(BlockManager(num_blocks, block_size, debug_hash_bits=debug_hash_bits), rng)
    for i in range(150):
        action = rng.random()
        if action < 0.35 or not sim.live:
            sim.admit(i)
        elif action < 0.8:
            sim.step(rng.choice(sim.live))
        else:
            sim.finish(rng.choice(sim.live))
        sim.check()
    for seq in list(sim.live):
        sim.finish(seq)
    sim.check()
    assert sim.bm.num_free_blocks == num_blocks


def test_random_operations_do_hit_the_cache() -> None:
    """The random driver above is not vacuous: with room, shared prefixes do get hits."""
    sim = Simulation(BlockManager(64, 4), random.Random(7))
    for i in range(200):
        sim.admit(i) if i % 3 == 0 or not sim.live else sim.step(sim.live[0])
        if len(sim.live) > 6:
            sim.finish(sim.live[0])
        sim.check()
    assert sim.num_hit_tokens > 0


def test_hit_shares_blocks_and_leaves_one_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    a = make_seq("a", list(range(12)))
    assert bm.admit(a, bm.match_prefix(a), 12)
    a.num_computed_tokens = 12
    bm.register_computed_blocks(a)
    b = make_seq("b", list(range(12)))
    hits = bm.match_prefix(b)
    assert hits == a.block_ids[:2]  # the third block would leave nothing to compute
    assert bm.admit(b, hits, 4)
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_computed_tokens == 8
    assert bm.num_used_blocks == 4
    bm.check_integrity()


def test_namespace_separates_identical_tokens() -> None:
    bm = BlockManager(8, 4)
    a = make_seq("a", list(range(9)), namespace=b"\1" * 16)
    assert bm.admit(a, [], 9)
    a.num_computed_tokens = 9
    bm.register_computed_blocks(a)
    assert bm.match_prefix(make_seq("b", list(range(9)), namespace=b"\2" * 16)) == []
    assert len(bm.match_prefix(make_seq("c", list(range(9)), namespace=b"\1" * 16))) == 2


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(4, 2)
    seqs = []
    for i in range(2):
        seq = make_seq(f"s{i}", [10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3, 99])
        assert bm.admit(seq, [], 4)
        seq.num_computed_tokens = 4
        bm.register_computed_blocks(seq)
        seqs.append(seq)
    assert bm.num_free_blocks == 0
    old_blocks = list(seqs[0].block_ids)
    bm.free(seqs[0])
    bm.free(seqs[1])
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 4
    new = make_seq("n", [7, 7, 7])
    assert bm.admit(new, [], 3)  # two blocks: s0's tail block goes first, then s0's head
    assert sorted(new.block_ids) == sorted(old_blocks)
    assert len(bm.match_prefix(seqs[1])) == 2 and bm.match_prefix(seqs[0]) == []
    assert bm.num_evictions == 2
    bm.check_integrity()


def test_admit_and_grow_change_nothing_when_blocks_run_out() -> None:
    bm = BlockManager(3, 4)
    a = make_seq("a", list(range(20)))
    assert not bm.admit(a, [], 13)
    assert a.block_ids == [] and bm.num_free_blocks == 3
    assert bm.admit(a, [], 12)
    assert not bm.grow(a, 13)
    assert len(a.block_ids) == 3
    bm.check_integrity()


def test_integrity_check_catches_corruption() -> None:
    bm = BlockManager(4, 4)
    bm._free.append(0)
    with pytest.raises(AssertionError, match="twice"):
        bm.check_integrity()


def test_a_remembered_match_follows_the_cache(monkeypatch) -> None:
    """A waiting request is matched several times; the match is verified once and then
    remembered only while no key joined or left the cache and no token was added."""
    bm = BlockManager(6, 4)
    verified = []
    real = bm._verified_prefix
    monkeypatch.setattr(bm, "_verified_prefix", lambda seq: verified.append(seq) or real(seq))
    a = make_seq("a", list(range(13)))
    assert bm.admit(a, [], 13)
    a.num_computed_tokens = 8
    bm.register_computed_blocks(a)
    waiting = make_seq("w", list(range(13)))
    assert bm.match_prefix(waiting) == bm.match_prefix(waiting) == a.block_ids[:2]
    assert len(verified) == 1  # the second call took the remembered match
    a.num_computed_tokens = 12
    bm.register_computed_blocks(a)  # a key joined: the match grows
    assert bm.match_prefix(waiting) == a.block_ids[:3] and len(verified) == 2
    waiting.token_ids.append(99)  # a token added (a preempted request's output)
    assert bm.match_prefix(waiting) == a.block_ids[:3] and len(verified) == 3
    held = list(a.block_ids)
    bm.free(a)
    other = make_seq("o", [50 + i for i in range(24)])
    assert bm.admit(other, [], 24)  # every block: the cached ones are evicted
    assert bm.match_prefix(waiting) == [] and len(verified) == 4
    assert sorted(other.block_ids) == other.block_ids and set(held) <= set(other.block_ids)
    bm.check_integrity()


def test_a_colliding_key_is_a_miss_from_the_block_whose_tokens_differ() -> None:
    """With 6-bit keys another prompt's second block collides with the cached one; the match
    (one joined compare first, then block by block) stops before it and counts a collision."""
    bm = BlockManager(12, 4, debug_hash_bits=6)
    a = make_seq("a", list(range(13)))
    assert bm.admit(a, [], 13)
    a.num_computed_tokens = 12
    bm.register_computed_blocks(a)
    for first in range(100, 5000):  # a second block whose truncated key equals a's
        b = make_seq("b", [*range(4), first, 5, 6, 7, *range(8, 13)])
        bm.update_hashes(b)
        if b.block_hashes[1] == a.block_hashes[1]:
            break
    else:
        pytest.fail("no colliding second block among 4,900 tries of 6-bit keys")
    assert bm.match_prefix(b) == a.block_ids[:1]
    assert bm.num_collisions == 1
    same = make_seq("same", list(range(13)))
    assert bm.match_prefix(same) == a.block_ids[:3] and bm.num_collisions == 1
    bm.check_integrity()


def test_a_cached_block_whose_stored_tokens_differ_is_a_miss() -> None:
    """The tokens are compared as well as the full-strength hash: a cached block whose stored
    tokens were altered ends the hit there (the joined compare fails, the block check finds it)."""
    bm = BlockManager(8, 4)
    a = make_seq("a", list(range(13)))
    assert bm.admit(a, [], 13)
    a.num_computed_tokens = 12
    bm.register_computed_blocks(a)
    second = a.block_ids[1]
    bm._cached[second] = bm._cached[second]._replace(token_bytes=bytes(16))
    assert bm.match_prefix(make_seq("b", list(range(13)))) == a.block_ids[:1]
    assert bm.num_collisions == 1
