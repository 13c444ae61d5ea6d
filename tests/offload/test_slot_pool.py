"""SlotPool: all-or-nothing takes, lowest slots first, and slots given back behind an event
free only once it completed (the device staging's launches), in the order given back."""

from __future__ import annotations

import pytest

from offload.external.slot_pool import SlotPool


class Event:
    """Stands in for a CUDA event: ``query`` says whether the launch before it completed."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_takes_are_all_or_nothing_lowest_first() -> None:
    pool = SlotPool(4)
    assert pool.take(3) == [0, 1, 2]
    assert pool.take(2) is None and pool.num_free == 1  # nothing taken by the refusal
    pool.give_back([1])
    assert sorted(pool.take(2)) == [1, 3]
    with pytest.raises(ValueError):
        SlotPool(0)


def test_slots_behind_an_event_come_back_once_it_completed_in_order() -> None:
    pool = SlotPool(4)
    a, b = pool.take(2), pool.take(2)
    first, second = Event(), Event()
    pool.give_back(a, after=first)
    pool.give_back(b, after=second)
    second.done = True  # the later one alone: a stream completes in order, so wait for both
    assert pool.num_free == 0 and pool.take(1) is None
    first.done = True
    assert pool.num_free == 4
    pool.give_back(pool.take(1))  # no event: free at once
    assert pool.num_free == 4
