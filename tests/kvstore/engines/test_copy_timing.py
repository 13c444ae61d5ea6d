"""CopyTiming: the sums a daemon's ``stats`` show as ``daemon.copy_ms`` (the pipelines that fill
it run on a GPU: ``test_daemon_cuda.py``)."""

from __future__ import annotations

import pytest

from kvstore.engines.copy_timing import PHASES, CopyTiming, CopyWay


def test_calls_add_up_by_way_and_devices_merge() -> None:
    timing = CopyTiming()
    assert timing.snapshot() == {}  # nothing timed: no empty ways either
    timing.add(CopyWay.LOAD, 3, total=0.010, to_first_submit=0.001, after_last_submit=0.004,
               store=0.0005, submitting=0.002)
    timing.add(CopyWay.LOAD, 1, total=0.002)
    snap = timing.snapshot()
    assert set(snap) == {"load"}
    assert snap["load"] == {"calls": 2, "chunks": 4, "ms_total": 12.0, "ms_to_first_submit": 1.0,
                            "ms_after_last_submit": 4.0, "ms_store": 0.5, "ms_submitting": 2.0}
    other = CopyTiming()
    other.add(CopyWay.SAVE, 2, total=0.005)
    other.add(CopyWay.LOAD, 1, total=0.003)
    merged = CopyTiming.merged([snap, other.snapshot()])
    assert merged["load"]["calls"] == 3 and merged["load"]["ms_total"] == 15.0
    assert merged["save"] == {"calls": 1, "chunks": 2, "ms_total": 5.0}


def test_an_unknown_phase_is_refused_and_nothing_is_added() -> None:
    timing = CopyTiming()
    with pytest.raises(ValueError, match="unknown copy phases"):
        timing.add(CopyWay.SAVE, 1, total=0.001, waiting=0.5)
    assert timing.snapshot() == {}
    assert "total" in PHASES
