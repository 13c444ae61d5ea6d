"""``server_timing``: a request's phases and queued parts from the engine's timing log; a line
whose stamps are missing or not numbers (a log edited by hand, a truncated write) gives no phases
rather than an exception or a made-up figure."""

from __future__ import annotations

import json

import pytest

from benchmarks.multiturn.server_timing import QUEUED_PARTS, join, queued_parts_ms

ROW = {"id": "chatcmpl-r1", "received": 10.001, "added": 10.002, "taken": 10.003,
       "restore": [10.004, 10.014, 10.015], "scheduled": 10.016, "first_token": 10.030,
       "first_token_seen": 10.031}


def test_a_restored_request_is_cut_into_parts_that_add_up_to_queued() -> None:
    parts = queued_parts_ms(ROW)
    assert list(parts) == list(QUEUED_PARTS)
    assert parts["restore"] == pytest.approx(10.0)
    assert sum(parts.values()) == pytest.approx(1e3 * (ROW["scheduled"] - ROW["added"]))


def test_a_request_without_a_restore_has_its_two_parts() -> None:
    parts = queued_parts_ms({**ROW, "restore": None})
    assert list(parts) == ["to_take", "to_schedule"]


@pytest.mark.parametrize("bad", [
    {"restore": [10.004, 10.014]},  # two stamps, not three
    {"restore": [10.004, "x", 10.015]},
    {"restore": "10.004"},
    {"restore": [10.004, None, 10.015]},
    {"taken": "10.003"},
    {"added": True},
    {"scheduled": None},
])
def test_a_malformed_stamp_gives_no_parts(bad: dict) -> None:
    assert queued_parts_ms({**ROW, **bad}) is None


def test_join_skips_what_it_cannot_read(tmp_path) -> None:
    log = tmp_path / "timing.jsonl"
    bad = {**ROW, "id": "chatcmpl-r2", "restore": ["a", "b", "c"], "first_token": "soon"}
    log.write_text("\n".join([json.dumps(ROW), "{not json", json.dumps(bad)]) + "\n")
    records = [{"request_id": rid, "sent_clock_s": 10.0, "ttft_s": 0.032}
               for rid in ("r1", "r2", "r3")]
    assert join(records, log) == 1
    good, malformed, missing = records
    assert sum(good["server"].values()) == pytest.approx(32.0)
    assert good["server_queued"]["to_send"] == pytest.approx(1.0)
    assert malformed["server"] is None and malformed["server_queued"] is None
    assert missing["server"] is None and missing["server_queued"] is None
