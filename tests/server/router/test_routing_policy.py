"""The router's policy (server/router/policy.py) on plain data, and a prompt's block chain as
the router builds it against the one the engine keys its blocks by."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from offload.idents import sequence_idents
from server.router.policy import (
    Candidate,
    EngineCosts,
    Placement,
    Route,
    RouteReason,
    RoutingPolicy,
    estimate,
)
from server.router.prompt_chain import KVIdentity, PromptChain
from server.router.routed_prefixes import RoutedPrefixes

PREFILL = 1 / 40_000  # seconds per computed token
COSTS = EngineCosts(PREFILL, {"hbm": PREFILL / 100, "dram": PREFILL / 10, "ssd": PREFILL / 2})
BS = 16


def _c(url: str, load: int = 0, num_hbm: int = 0, queued: int = 0) -> Candidate:
    """``queued``: prefill tokens queued on it (their seconds at ``PREFILL``)."""
    return Candidate(url, load, num_hbm, queued * PREFILL, COSTS)


def _pick(policy: RoutingPolicy, candidates: list[Candidate], placement: Placement | None):
    route = policy.choose(candidates, placement)
    return route.url, route.reason, route.expected_hit_blocks


def test_the_estimate_prices_each_block_where_it_is_cheapest() -> None:
    placement = Placement(num_tokens=100 * BS, block_size=BS, num_dram=60, num_stored=80)
    # own HBM 10 blocks free; 10..40 from the peer's HBM; 40..60 DRAM; 60..80 SSD; 80.. computed
    est = estimate(_c("a", num_hbm=10, queued=1000), 40, placement)
    want = (1000 * PREFILL + 30 * BS * COSTS.restore_s_per_token["hbm"]
            + 20 * BS * COSTS.restore_s_per_token["dram"]
            + 20 * BS * COSTS.restore_s_per_token["ssd"] + 20 * BS * PREFILL)
    assert est.seconds == pytest.approx(want)
    assert est.cached_blocks == 80 and est.compute_tokens == 20 * BS
    # an SSD slower than computing is not restored from: the engine would compute it too
    slow = EngineCosts(PREFILL, {"hbm": PREFILL / 100, "dram": PREFILL / 10, "ssd": PREFILL * 2})
    est = estimate(Candidate("a", 0, 0, 0, slow), 0, placement)
    assert est.cached_blocks == 60 and est.compute_tokens == 40 * BS


def test_a_warm_engine_keeps_its_conversation_until_its_queue_costs_more_than_a_restore() -> None:
    policy = RoutingPolicy("kv")
    placement = Placement(num_tokens=1200 * BS, block_size=BS, num_dram=1100, num_stored=1100)
    # idle: the engine holding 1,100 blocks in HBM wins outright
    assert _pick(policy, [_c("a", 0, 1100), _c("b", 0)], placement) == \
        ("a", RouteReason.HBM_HIT, 1100)
    # a's queue (8k tokens: 0.2 s) costs more than b restoring 1,100 blocks from a's HBM
    assert _pick(policy, [_c("a", 1, 1100, queued=8000), _c("b", 0)], placement)[:2] == \
        ("b", RouteReason.HBM_BUSY)
    # a short queue does not: the restore would cost more than the wait
    assert _pick(policy, [_c("a", 1, 1100, queued=20), _c("b", 0)], placement)[0] == "a"


def _routed_in_turn(policy: RoutingPolicy, hbm: dict[str, int], placement: Placement,
                    num: int) -> list[tuple[Route, float]]:
    """``num`` requests of ``placement`` routed one after another, each joining its engine's
    queue as the router does (its ``work_s``); each route with the queue it found there."""
    queued = dict.fromkeys(hbm, 0.0)
    out = []
    for _ in range(num):
        route = policy.choose([Candidate(url, 0, blocks, queued[url], COSTS)
                               for url, blocks in hbm.items()], placement)
        out.append((route, queued[route.url]))
        queued[route.url] += route.work_s
    return out


def test_a_shared_system_prompt_does_not_pull_every_new_conversation_to_one_engine() -> None:
    """Every first turn shares 64 blocks of system prompt held by engine a; the router queues
    each routed prompt on its engine: new conversations alternate, not pile up on a."""
    placement = Placement(num_tokens=1200 * BS, block_size=BS, num_dram=64, num_stored=64)
    routes = _routed_in_turn(RoutingPolicy("kv"), {"a": 64, "b": 0}, placement, 6)
    chosen = [route.url for route, _ in routes]
    assert Counter(chosen) == {"a": 3, "b": 3}, chosen


def test_restores_queue_on_their_engine_so_later_turns_from_dram_spread() -> None:
    """Seen on two H200s whose HBM holds no conversation between its turns: every later turn
    restored ~1,190 blocks from DRAM and computed ~160 tokens. Counting only the computed
    tokens as queued, one engine took ten such turns in a row (2-3 s first tokens); the
    restores it was sent are work in its queue too."""
    placement = Placement(num_tokens=1200 * BS, block_size=BS, num_dram=1190, num_stored=1190)
    routes = _routed_in_turn(RoutingPolicy("kv"), {"a": 64, "b": 64}, placement, 8)
    for route, queued_s in routes:
        assert route.work_s == pytest.approx(route.estimate_s - queued_s)
        assert route.work_s > route.compute_tokens * PREFILL  # the restore is in it
    chosen = [route.url for route, _ in routes]
    assert Counter(chosen) == {"a": 4, "b": 4}, chosen


def test_cold_prompts_spread_dram_hits_and_fallbacks_go_by_load() -> None:
    policy = RoutingPolicy("kv")
    cold = [_c("a", 3), _c("b", 1), _c("c", 2)]
    assert _pick(policy, cold, Placement(90, BS, 5, 5)) == ("b", RouteReason.DRAM_HIT, 5)
    assert _pick(policy, cold, Placement(90, BS)) == ("b", RouteReason.MISS, 0)
    assert _pick(policy, cold, None) == ("b", RouteReason.FALLBACK, 0)
    # a queue on an engine weighs more than requests in flight
    assert _pick(policy, [_c("a", 0, queued=5000), _c("b", 3)], Placement(90, BS))[0] == "b"


def test_equal_loads_take_turns_and_round_robin_ignores_load() -> None:
    policy = RoutingPolicy("kv")
    idle = [_c("a"), _c("b"), _c("c")]
    assert Counter(_pick(policy, idle, Placement(90, BS))[0] for _ in range(6)) == \
        {"a": 2, "b": 2, "c": 2}
    loaded = [_c("a", 0, 9), _c("b", 5), _c("c", 9)]
    rr = RoutingPolicy("round-robin")
    assert [_pick(rr, loaded, None)[:2] for _ in range(3)] == [
        ("a", RouteReason.ROUND_ROBIN), ("b", RouteReason.ROUND_ROBIN),
        ("c", RouteReason.ROUND_ROBIN)]
    assert _pick(RoutingPolicy("least-loaded"), loaded[::-1], None)[:2] == \
        ("a", RouteReason.LEAST_LOADED)
    with pytest.raises(ValueError):
        RoutingPolicy("random")
    with pytest.raises(ValueError):
        policy.choose([], None)


def test_each_tenant_takes_its_own_turns() -> None:
    """One tenant's alternation must not reveal whether another's requests were routed (the
    shared counter moved only when they were)."""
    for mode in ("round-robin", "kv"):
        policy = RoutingPolicy(mode)
        idle = [_c("a"), _c("b")]
        placement = None if mode == "round-robin" else Placement(90, BS)
        mine = [policy.choose(idle, placement, "tenant-1").url for _ in range(2)]
        for _ in range(3):  # another tenant's requests in between
            policy.choose(idle, placement, "tenant-2")
        mine += [policy.choose(idle, placement, "tenant-1").url for _ in range(2)]
        assert mine == ["a", "b", "a", "b"], (mode, mine)


def test_engines_are_priced_at_the_nodes_median_prefill_rate() -> None:
    """Seen on two H200s: one engine's early estimate said 12k tokens/s, the other's 36k, for
    the same prefills. Priced at their own rates, a new conversation went behind an 18k-token
    queue on the "fast" one instead of to the idle "slow" one."""
    policy = RoutingPolicy("kv")
    slow = EngineCosts(1 / 12_000, COSTS.restore_s_per_token, prefill_measured=True)
    fast = EngineCosts(1 / 36_000, COSTS.restore_s_per_token, prefill_measured=True)
    placement = Placement(num_tokens=1188 * BS, block_size=BS, num_dram=64, num_stored=64)
    queue_s = 18_000 / 36_000
    candidates = [Candidate("idle", 0, 64, 0.0, slow), Candidate("busy", 1, 64, queue_s, fast)]
    assert policy.choose(candidates, placement).url == "idle"
    # an engine still on its prior takes the node's rate too
    prior = EngineCosts(1 / 1_000, COSTS.restore_s_per_token, prefill_measured=False)
    candidates = [Candidate("idle", 0, 64, 0.0, prior), Candidate("busy", 1, 64, queue_s, fast)]
    assert policy.choose(candidates, placement).url == "idle"


def test_an_engine_that_has_not_restored_yet_is_priced_at_the_nodes_measured_rate() -> None:
    """Seen on two H200s: the engine that had restored measured 46 GB/s from DRAM, the other
    still had its 20 GB/s prior, so every later turn looked twice as cheap on the first."""
    policy = RoutingPolicy("kv")
    rates = dict(COSTS.restore_s_per_token)
    measured = EngineCosts(PREFILL, rates, True, frozenset({"dram"}))
    prior = EngineCosts(PREFILL, {**rates, "dram": rates["dram"] * 2.3}, True)
    placement = Placement(num_tokens=1200 * BS, block_size=BS, num_dram=1190, num_stored=1190)
    routes = [policy.choose([Candidate("measured", 0, 64, 0.0, measured),
                             Candidate("prior", 0, 64, 0.0, prior)], placement)
              for _ in range(4)]
    assert len({r.estimate_s for r in routes}) == 1  # one price on both
    assert Counter(r.url for r in routes) == {"measured": 2, "prior": 2}


def test_engine_costs_come_from_the_load_report() -> None:
    costs = EngineCosts.from_report({"prefill_tokens_per_s": 40_000, "kv_bytes_per_token": 1000,
                                     "restore_bytes_per_s": {"dram": 2e10, "hbm": 0},
                                     "restore_measured": ["dram"]})
    assert costs.prefill_s_per_token == pytest.approx(1 / 40_000)
    assert costs.restore_measured == {"dram"}
    assert costs.restore_s_per_token["dram"] == pytest.approx(1000 / 2e10)
    assert costs.restore_s_per_token["hbm"] == EngineCosts().restore_s_per_token["hbm"]
    for bad in (None, {}, {"prefill_tokens_per_s": "x"}, {"prefill_tokens_per_s": 0,
                                                           "kv_bytes_per_token": 1,
                                                           "restore_bytes_per_s": {}}):
        assert EngineCosts.from_report(bad) == EngineCosts()


def test_routed_prefixes_mark_at_once_expire_and_stay_bounded() -> None:
    marks = RoutedPrefixes(ttl_s=10.0, max_blocks=8)
    chain = [bytes([i]) * 16 for i in range(6)]
    marks.mark("a", chain[:4], now=0.0)
    assert marks.held("a", chain, now=1.0) == 4 and marks.held("b", chain, now=1.0) == 0
    marks.mark("b", chain[:2], now=2.0)  # the shared head sent to b too: a keeps it
    assert marks.held("a", chain, now=3.0) == 4 and marks.held("b", chain, now=3.0) == 2
    assert marks.held("a", chain, now=10.5) == 0 and marks.held("b", chain, now=10.5) == 2
    marks.mark("c", [bytes([9]) * 16 for _ in range(1)] + [bytes([i + 50]) * 16
                                                            for i in range(7)], now=4.0)
    assert len(marks) == 8  # the oldest marks went first
    assert marks.held("a", chain, now=5.0) < 4


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
