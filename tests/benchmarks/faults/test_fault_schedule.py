"""The fault soak's schedule: seeded, every kind at least once, inside its quiet start and end,
and refused when there is no room for every kind."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.faults.schedule import ALL_KINDS, FaultKind, describe, make_schedule, parse_kinds


def test_ten_minutes_hold_every_kind_twice_in_order_and_inside_the_window() -> None:
    faults = make_schedule(600, 60, seed=0)
    assert len(faults) == 9 and [f.index for f in faults] == list(range(9))
    assert min(Counter(f.kind for f in faults).values()) >= 2
    times = [f.at_s for f in faults]
    assert times == sorted(times) and times[0] == 30 and times[-1] <= 540
    assert min(b - a for a, b in zip(times, times[1:])) >= 0.6 * 60  # jitter keeps them apart
    for f in faults:
        assert (5 <= f.hold_s <= 10) if f.kind is FaultKind.DAEMON_STOP else f.hold_s == 0
    assert make_schedule(600, 60, seed=0) == faults
    assert make_schedule(600, 60, seed=1) != faults
    assert describe(faults).count("\n") == 8 and "daemon-stop for" in describe(faults)


def test_a_schedule_with_room_for_as_many_faults_as_kinds_has_each_once() -> None:
    faults = make_schedule(21, 4.5, seed=3, first_s=2, tail_s=3)
    assert sorted(f.kind.value for f in faults) == sorted(k.value for k in ALL_KINDS)


def test_too_little_room_and_unknown_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="room for 1 fault"):
        make_schedule(60, 30, seed=0)
    with pytest.raises(ValueError, match="must be > 0"):
        make_schedule(60, 0, seed=0)
    assert parse_kinds("all") == ALL_KINDS
    assert parse_kinds("engine-kill,daemon-stop,engine-kill") == (FaultKind.ENGINE_KILL,
                                                                  FaultKind.DAEMON_STOP)
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_kinds("daemon-pause")
    assert [f.kind for f in make_schedule(60, 10, seed=0, kinds=(FaultKind.DAEMON_KILL,))] == [
        FaultKind.DAEMON_KILL] * 5  # at 5, 15, ..., 45 s: 10 s quiet at the end
