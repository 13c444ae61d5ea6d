"""The restore decision's step model (floor, marginal prefill cost, busy vs idle) and its load
bandwidth samples (busy periods)."""

from __future__ import annotations

import pytest

from offload.load_periods import MAX_LOADS_PER_SAMPLE, LoadBusyPeriods, busy_seconds
from offload.restore import lookup_wait_budget_s
from offload.restore_policy import BUSY_RECOMPUTE_FACTOR, RestorePolicy


def _policy() -> RestorePolicy:
    return RestorePolicy({"dram": 50e9}, prior_prefill_tokens_per_s=1e4)


def test_priors_decide_until_measured() -> None:
    policy = _policy()
    assert policy.expected_prefill_s(1000) == pytest.approx(0.1)
    assert policy.step_floor_s() == 0.0
    assert policy.should_restore("dram", 1000, 100 * 2**20)  # ~2.6 ms load vs 100 ms
    assert not policy.should_restore("dram", 16, 2**30)


def test_small_host_bound_prefills_do_not_make_large_ones_look_slow() -> None:
    policy = _policy()
    for _ in range(10):
        policy.observe_step(0, 0.005)  # decode steps: the floor
    for tokens, seconds in [(40, 0.015), (2000, 0.045), (40, 0.014), (1000, 0.030),
                            (40, 0.016), (2000, 0.046)]:
        policy.observe_step(tokens, seconds)
    assert policy.step_floor_s() == pytest.approx(0.005)
    per_token = policy.expected_prefill_s(1000) / 1000
    # the line's slope or the large steps' own cost, not (15 - 5) ms / 40 tokens
    assert 10e-6 < per_token < 30e-6
    assert policy.snapshot()["prefill_tokens_per_s"] == pytest.approx(1 / per_token)


def test_alike_prefill_sizes_fall_back_to_the_average_cost() -> None:
    policy = _policy()
    policy.observe_step(0, 0.005)
    for _ in range(5):
        policy.observe_step(100, 0.007)
    assert policy.expected_prefill_s(100) == pytest.approx(0.002)


def test_a_busy_engine_restores_only_what_beats_a_step() -> None:
    policy = _policy()
    policy.observe_step(0, 0.005)
    for tokens, seconds in [(100, 0.0065), (2000, 0.035), (500, 0.0125)]:
        policy.observe_step(tokens, seconds)
    factor = BUSY_RECOMPUTE_FACTOR
    assert factor * policy.expected_prefill_s(100) < policy.step_floor_s()
    # 100 tokens: cheaper to recompute, even charged for the others' lost GPU time, than to sit
    # out a step; idle, a quick load wins.
    assert not policy.restore_wins(0.001, 100, busy=True)
    assert policy.restore_wins(0.001, 100, busy=False)
    # 2,000 tokens: worth a step either way; a load slower than recomputing never is.
    assert policy.restore_wins(0.006, 2000, busy=True)
    assert not policy.restore_wins(1.0, 2000, busy=False)
    assert not policy.restore_wins(0.0, 0, busy=False)


def test_a_busy_engine_charges_a_recompute_for_the_gpu_time_it_takes_from_others() -> None:
    policy = _policy()
    policy.observe_step(0, 0.005)
    for tokens, seconds in [(100, 0.0065), (2000, 0.035), (500, 0.0125)]:
        policy.observe_step(tokens, seconds)
    recompute_s = policy.expected_prefill_s(18000)
    slower_load_s = 1.5 * recompute_s  # e.g. queued behind other users' loads
    assert not policy.restore_wins(slower_load_s, 18000, busy=False)
    assert policy.restore_wins(slower_load_s, 18000, busy=True)
    assert not policy.restore_wins(2.5 * recompute_s, 18000, busy=True)  # a slow SSD still loses


def test_nonsense_samples_are_ignored() -> None:
    policy = _policy()
    policy.observe_step(100, 0.0)
    policy.observe_step(-5, 1.0)
    policy.observe_load("dram", 0, 1.0)
    policy.observe_load("dram", 10, -1.0)
    assert policy.expected_prefill_s(1000) == pytest.approx(0.1)
    assert policy.step_floor_s() == 0.0
    assert policy.expected_load_s("dram", 50 * 10**9) == pytest.approx(1.0005)


def test_recompute_is_never_estimated_below_what_large_prefill_steps_cost() -> None:
    # Long cold chunks cost ~25 us a token above the floor; short restored remainders over deep
    # contexts cost more a step than their tokens suggest, which flattens the line's slope.
    policy = _policy()
    policy.observe_step(0, 0.008)
    for _ in range(4):
        for tokens, seconds in [(2048, 0.060), (300, 0.030), (2048, 0.059), (600, 0.040)]:
            policy.observe_step(tokens, seconds)
    bulk = (0.0595 - 0.008) / 2048
    assert policy.expected_prefill_s(18000) == pytest.approx(18000 * bulk, rel=0.05)
    # an 18k-token restore at ~150 ms (2.7 GB at ~18 GB/s, queued) still beats recomputing
    assert policy.restore_wins(0.15, 18000, busy=True)
    assert policy.restore_wins(0.15, 18000, busy=False)


def test_a_declined_restore_leaves_its_estimates_in_the_snapshot() -> None:
    policy = _policy()
    assert policy.snapshot()["last_declined"] is None
    policy.note_declined(load_s=0.5, num_tokens=100, busy=True)
    declined = policy.snapshot()["last_declined"]
    assert declined["load_s"] == 0.5 and declined["num_tokens"] == 100 and declined["busy"]
    assert declined["recompute_s"] == pytest.approx(
        BUSY_RECOMPUTE_FACTOR * policy.expected_prefill_s(100))


def test_one_slow_large_step_does_not_hold_the_recompute_estimate() -> None:
    policy = _policy()
    policy.observe_step(0, 0.006)
    policy.observe_step(2048, 1.9)  # e.g. a plan built inside the step
    for _ in range(4):
        policy.observe_step(2048, 0.056)
    assert policy.expected_prefill_s(2048) == pytest.approx(0.050, rel=0.05)


def test_serial_loads_each_give_their_own_sample() -> None:
    periods = LoadBusyPeriods()
    periods.started()
    assert periods.ended(10.0, 10.5, {"dram": 50}) == ("dram", 50, 0.5)
    periods.started()  # idle between: the gap is no one's time
    assert periods.ended(11.0, 11.25, {"dram": 50}) == ("dram", 50, 0.25)


def test_overlapping_loads_give_one_sample_over_their_busy_time() -> None:
    """Two loads whose chunks interleave land close together: the second's time since the
    first landed is tiny, but their bytes over the union of their lifetimes is the bus's."""
    periods = LoadBusyPeriods()
    periods.started()
    periods.started()
    assert periods.ended(0.0, 0.099, {"dram": 100}) is None  # one still in flight
    assert periods.ended(0.01, 0.1, {"dram": 100, "ssd": 20}) == ("dram", 220, 0.1)
    # polled out of order, and a gap in the middle that no load spans
    periods.started()
    periods.started()
    periods.started()
    assert periods.ended(1.0, 1.3, {"dram": 10}) is None
    assert periods.ended(2.0, 2.1, {"dram": 10}) is None
    assert periods.ended(1.2, 1.25, {"dram": 10}) == ("dram", 30, pytest.approx(0.4))


def test_a_load_that_landed_nothing_adds_neither_bytes_nor_time() -> None:
    periods = LoadBusyPeriods()
    periods.started()
    periods.started()
    assert periods.ended(0.0, 5.0, {}) is None  # failed or given up: its 5 s count for none
    assert periods.ended(0.0, 0.2, {"dram": 100}) == ("dram", 100, 0.2)
    periods.started()
    assert periods.ended(1.0, 1.5, {}) is None  # nothing landed in the whole period
    assert periods.in_flight == 0
    assert periods.ended(2.0, 2.5, {"dram": 1}) is None  # more endings than starts: ignored


def test_steady_traffic_still_gives_samples() -> None:
    """Loads always in flight never close a period by themselves: every
    ``MAX_LOADS_PER_SAMPLE`` endings give a sample."""
    periods = LoadBusyPeriods()
    periods.started()
    samples = []
    for i in range(3 * MAX_LOADS_PER_SAMPLE):
        periods.started()  # the next starts before this one ends
        samples.append(periods.ended(i * 0.1, i * 0.1 + 0.1, {"dram": 10}))
    got = [s for s in samples if s is not None]
    assert len(got) == 3 and all(s == ("dram", 80, pytest.approx(0.8)) for s in got)
    assert periods.in_flight == 1


def test_busy_seconds_is_the_union_of_the_intervals() -> None:
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6)]) == pytest.approx(3.0)


def test_the_policy_remembers_the_latest_step() -> None:
    policy = _policy()
    assert policy.last_step_s() == 0.0
    policy.observe_step(0, 0.006)
    policy.observe_step(2048, 0.3)
    assert policy.last_step_s() == 0.3


def test_a_step_waits_for_lookup_replies_by_the_previous_steps_length() -> None:
    assert lookup_wait_budget_s(0.0) == pytest.approx(0.002)  # decode steps: the floor
    assert lookup_wait_budget_s(0.2) == pytest.approx(0.01)  # a long prefill chunk: 5%
    assert lookup_wait_budget_s(5.0) == pytest.approx(0.02)  # never more than the cap
    # a likely hit (a block this engine saved) may hold a long step a quarter of it, capped
    assert lookup_wait_budget_s(0.006, likely_hit=True) == pytest.approx(0.002)
    assert lookup_wait_budget_s(0.1, likely_hit=True) == pytest.approx(0.025)
    assert lookup_wait_budget_s(0.4, likely_hit=True) == pytest.approx(0.05)


def test_a_tiers_first_load_is_its_warm_up_not_its_bandwidth() -> None:
    """Seen on two H200s: the first restore from a peer GPU's arena ran cold (mappings and
    kernels on first use); taken as the tier's bandwidth, it made every later restore from the
    peer look slower than recomputing."""
    policy = RestorePolicy({"hbm": 200e9}, prior_prefill_tokens_per_s=35e3)
    policy.observe_load("hbm", 151 << 20, 0.35)  # the warm-up: not taken
    assert policy.should_restore("hbm", 18_000, 18_000 * 147_456)
    policy.observe_load("hbm", 2650 << 20, 0.03)  # then measured
    assert policy.expected_load_s("hbm", 2650 << 20) == pytest.approx(0.0305, rel=0.05)


def test_a_declined_tier_is_probed_now_and_then() -> None:
    """An estimate only a load can correct: after PROBE_EVERY declines in a row, one restore
    goes ahead (counted), so one slow sample cannot switch a tier off for good."""
    from collections import Counter
    from types import SimpleNamespace

    from offload.core.restorer import Tier
    from offload.cost_decider import PROBE_EVERY, CostDecider

    policy = RestorePolicy({"dram": 1.0}, prior_prefill_tokens_per_s=1e12)  # hopeless loads
    counters: Counter[str] = Counter()
    decider = CostDecider(policy, 1 << 20, 16, counters)
    job = SimpleNamespace(tiers=[Tier.DRAM] * 4, num_hit=4, busy=False)
    decisions = [decider.worth_loading(job) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1] and decisions[-1]
    assert counters["restores_probed"] == 2
