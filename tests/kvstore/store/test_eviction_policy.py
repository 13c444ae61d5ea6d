"""One contract test run against every eviction policy, plus what makes each one itself."""

from __future__ import annotations

import pytest

from kvstore.store.eviction import POLICIES, FIFOPolicy, LRUPolicy, make_policy


@pytest.fixture(params=sorted(POLICIES))
def policy(request):
    return make_policy(request.param)


def test_contract_tracks_keys_and_yields_each_once(policy):
    for key in "abcde":
        policy.insert(key)
    assert len(policy) == 5 and "c" in policy and "z" not in policy
    assert sorted(policy.victims()) == list("abcde")
    policy.remove("c")
    policy.remove("z")  # untracked: a no-op
    policy.touch("z")
    assert "c" not in policy and len(policy) == 4
    assert sorted(policy.victims()) == list("abde")


def test_contract_untouched_keys_leave_oldest_first(policy):
    for key in range(10):
        policy.insert(key)
    assert list(policy.victims()) == list(range(10))


def test_contract_removed_then_reinserted_key_is_newest(policy):
    for key in "abc":
        policy.insert(key)
    policy.remove("a")
    policy.insert("a")
    assert list(policy.victims()) == ["b", "c", "a"]


def test_contract_collect_then_remove(policy):
    for key in range(6):
        policy.insert(key)
    chosen = [k for k in policy.victims() if k % 2 == 0]
    for k in chosen:
        policy.remove(k)
    assert list(policy.victims()) == [1, 3, 5]


def test_lru_touch_moves_a_key_to_the_back():
    p = LRUPolicy()
    for key in "abc":
        p.insert(key)
    p.touch("a")
    assert list(p.victims()) == ["b", "c", "a"]


def test_fifo_ignores_touches():
    p = FIFOPolicy()
    for key in "abc":
        p.insert(key)
    p.touch("a")
    assert list(p.victims()) == ["a", "b", "c"]


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="lru"):
        make_policy("arc")
