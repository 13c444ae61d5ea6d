"""The router's policy (server/routing.py) on plain data, and a prompt's block chain as the router
builds it against the one the engine keys its blocks by."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from kvstore.wire.verbs import MAX_LOCATE_BLOCKS
from offload.idents import sequence_idents
from server.prompt_chain import MAX_CHAIN_BLOCKS, KVIdentity, PromptChain
from server.routing import Candidate, RouteReason, RoutingPolicy


def _pick(policy: RoutingPolicy, candidates: list[Candidate], num_stored: int | None = 0):
    route = policy.choose(candidates, num_stored)
    return route.name, route.reason, route.expected_hit_blocks


def test_the_longest_hbm_prefix_wins_ties_and_misses_go_to_the_least_loaded() -> None:
    policy = RoutingPolicy("kv", load_slack=4)
    a, b, c = (Candidate("a", 3, 5), Candidate("b", 0, 2), Candidate("c", 1, 0))
    assert _pick(policy, [a, b, c], num_stored=7) == ("a", RouteReason.HBM_HIT, 7)
    # Equal prefixes: the less loaded of the holders, not the least loaded overall.
    tied = [Candidate("a", 3, 5), Candidate("b", 2, 5), Candidate("c", 0, 0)]
    assert _pick(policy, tied, 5) == ("b", RouteReason.HBM_HIT, 5)
    # Only the store holds it (DRAM or SSD), or nobody: the least loaded.
    cold = [Candidate("a", 3), Candidate("b", 1), Candidate("c", 2)]
    assert _pick(policy, cold, 9) == ("b", RouteReason.DRAM_HIT, 9)
    assert _pick(policy, cold, 0) == ("b", RouteReason.MISS, 0)
    # No answer from the daemon: the least loaded, as a fallback.
    assert _pick(policy, [a, b, c], None) == ("b", RouteReason.FALLBACK, 0)


def test_a_holder_over_the_load_slack_is_passed_over() -> None:
    policy = RoutingPolicy("kv", load_slack=2)
    assert _pick(policy, [Candidate("a", 3, 8), Candidate("b", 1)], 0)[:2] == \
        ("a", RouteReason.HBM_HIT)
    assert _pick(policy, [Candidate("a", 4, 8), Candidate("b", 1)], 0) == \
        ("b", RouteReason.HBM_BUSY, 8)


def test_equal_loads_take_turns_and_round_robin_ignores_load() -> None:
    policy = RoutingPolicy("kv")
    idle = [Candidate("a", 0), Candidate("b", 0), Candidate("c", 0)]
    assert Counter(_pick(policy, idle)[0] for _ in range(6)) == {"a": 2, "b": 2, "c": 2}
    loaded = [Candidate("a", 0, 9), Candidate("b", 5), Candidate("c", 9)]
    rr = RoutingPolicy("round-robin")
    assert [_pick(rr, loaded, None)[:2] for _ in range(3)] == [
        ("a", RouteReason.ROUND_ROBIN), ("b", RouteReason.ROUND_ROBIN),
        ("c", RouteReason.ROUND_ROBIN)]
    assert _pick(RoutingPolicy("least-loaded"), loaded[::-1], 3)[:2] == \
        ("a", RouteReason.LEAST_LOADED)
    with pytest.raises(ValueError):
        RoutingPolicy("random")
    with pytest.raises(ValueError):
        policy.choose([])


def test_the_routers_chain_is_the_engines(tiny_model_dir: Path) -> None:
    """Hashes and idents from the identity the engine reports equal the engine's own keys."""
    with LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32) as llm:
        engine = llm.engine
        prompt = [(5 * i) % 700 + 3 for i in range(16 * 4 + 1)]  # one token past 4 blocks
        identity = KVIdentity.from_report(dataclasses.asdict(engine.model_identity),
                                          engine.config.block_size)
        chain = PromptChain.of(identity, prompt, "tenant-x")
        engine.add_request("r", prompt, SamplingParams(max_tokens=4), cache_salt="tenant-x")
        engine.step()  # prefilled: its block hashes are made
        (seq,) = [s for s in engine.scheduler.running if s.request_id == "r"]
        assert chain.namespace == engine.namespace("tenant-x").digest == seq.namespace_digest
        assert chain.hashes == seq.block_hashes[:4]
        assert chain.idents == sequence_idents(seq, range(4), 16)
        # A prompt of exactly four blocks leaves its last token to compute: three blocks.
        assert len(PromptChain.of(identity, prompt[:64], "tenant-x")) == 3
        assert PromptChain.of(identity, prompt, "other").namespace != chain.namespace
    assert MAX_CHAIN_BLOCKS == MAX_LOCATE_BLOCKS  # no chain the daemon would refuse
