"""LinkQueue: lookups (urgent) overtake queued saves and publications, which keep their order;
one bound for both lanes; a wake-up returns at once."""

from __future__ import annotations

import threading
import time

import pytest

from offload.link_queue import LinkQueue, QueueFull


def test_urgent_items_come_first_and_each_lane_keeps_its_order() -> None:
    q: LinkQueue[str] = LinkQueue(8)
    for item in ("save-1", "resident", "save-2"):
        q.put(item)
    q.put("lookup-1", urgent=True)
    q.put("lookup-2", urgent=True)
    assert len(q) == 5
    taken = [q.get(0.0) for _ in range(5)]
    assert taken == ["lookup-1", "lookup-2", "save-1", "resident", "save-2"]
    assert q.get(0.0) is None and len(q) == 0


def test_one_bound_for_both_lanes() -> None:
    q: LinkQueue[int] = LinkQueue(2)
    q.put(1)
    q.put(2, urgent=True)
    with pytest.raises(QueueFull):
        q.put(3, urgent=True)
    with pytest.raises(QueueFull):
        q.put(4)
    assert q.take_all() == [2, 1]
    q.put(5)  # room again
    assert q.get(0.0) == 5
    with pytest.raises(ValueError):
        LinkQueue(0)


def test_get_waits_for_an_item_or_its_timeout_and_a_wake_up_returns_none_at_once() -> None:
    q: LinkQueue[str] = LinkQueue(4)
    started = time.monotonic()
    assert q.get(0.05) is None
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.05, q.put, ("late",)).start()
    assert q.get(5.0) == "late"
    q.put("queued")
    threading.Timer(0.05, q.wake).start()
    assert q.get(5.0) == "queued"  # items before a later wake-up
    started = time.monotonic()
    assert q.get(5.0) is None
    assert time.monotonic() - started < 2.0
    q.put("after")
    q.wake()
    assert q.get(0.0) is None  # a wake-up goes before what is queued
    assert q.get(0.0) == "after"
