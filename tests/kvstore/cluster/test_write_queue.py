"""The cluster index's write queue: what waits for Redis, in which order, within its budget."""

from collections import Counter

from kvstore.cluster.redis_scripts import FORGET, PUBLISH, UNPUBLISH
from kvstore.cluster.write_queue import WriteQueue

NS = b"n" * 16
ENTRY = b"node-a/1234"


def _hashes(*ids: int) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in ids]


def test_a_block_advertised_twice_is_queued_once_and_its_withdrawal_wins():
    counters: Counter[str] = Counter()
    queue = WriteQueue(ENTRY, max_events=100, counters=counters)
    queue.advertise(NS, _hashes(1, 2), held=True)
    queue.advertise(NS, _hashes(2), held=True)  # a save and a resident block: one event
    assert len(queue) == 2 and counters["published"] == 2
    queue.advertise(NS, _hashes(1), held=False)
    batch = queue.take(10)
    assert [(key[16:], op) for key, (op, _) in batch] == [
        (_hashes(2)[0], PUBLISH), (_hashes(1)[0], UNPUBLISH)]  # the newest event of a key last
    assert queue.held == {NS + _hashes(2)[0]} and queue.in_flight == 2 and not len(queue)


def test_past_its_budget_the_oldest_events_are_dropped_and_counted():
    counters: Counter[str] = Counter()
    queue = WriteQueue(ENTRY, max_events=3, counters=counters)
    queue.advertise(NS, _hashes(1, 2, 3, 4, 5), held=True)
    assert len(queue) == 3 and counters["dropped_events"] == 2
    assert [key[16:] for key, _ in queue.take(10)] == _hashes(3, 4, 5)
    assert len(queue.held) == 5  # still advertised: a resync sends them all


def test_a_failed_batch_goes_back_in_front_unless_a_newer_event_replaced_it():
    counters: Counter[str] = Counter()
    queue = WriteQueue(ENTRY, max_events=100, counters=counters)
    queue.advertise(NS, _hashes(1, 2), held=True)
    batch = queue.take(2)
    queue.advertise(NS, _hashes(2), held=False)  # while the batch was out
    queue.advertise(NS, _hashes(3), held=True)
    queue.requeue(batch)
    assert queue.in_flight == 0
    events = [(key[16:], op) for key, (op, _) in queue.take(10)]
    assert events == [(_hashes(1)[0], PUBLISH), (_hashes(2)[0], UNPUBLISH),
                      (_hashes(3)[0], PUBLISH)]
    queue.acknowledge(batch)
    assert counters["flush_batches"] == 1 and counters["flushed_events"] == 2


def test_a_stale_entry_never_replaces_this_nodes_own_event_and_resync_sends_all_held():
    counters: Counter[str] = Counter()
    queue = WriteQueue(ENTRY, max_events=100, counters=counters)
    queue.advertise(NS, _hashes(1), held=True)
    queue.forget([(NS + _hashes(1)[0], b"old/1"), (NS + _hashes(9)[0], b"old/1")])
    assert counters["stale_entries"] == 2
    assert dict(queue.take(10)) == {NS + _hashes(1)[0]: (PUBLISH, ENTRY),
                                    NS + _hashes(9)[0]: (FORGET, b"old/1")}
    queue.resync()
    assert dict(queue.take(10)) == {NS + _hashes(1)[0]: (PUBLISH, ENTRY)}
