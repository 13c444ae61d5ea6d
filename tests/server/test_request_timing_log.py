"""The request timing log: one line per request, 0600, bounded, and a full disk stops it
quietly (serving goes on)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from server.request_timing_log import NoTimingLog, RequestTimingLog


def test_lines_are_appended_and_the_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "timing.jsonl"
    log = RequestTimingLog(path)
    log.record({"id": "chatcmpl-a", "received": 1.5})
    log.record({"id": "chatcmpl-b", "received": 2.5})
    log.close()
    again = RequestTimingLog(path)  # a restart appends
    again.record({"id": "chatcmpl-c", "received": 3.5})
    again.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["chatcmpl-a", "chatcmpl-b", "chatcmpl-c"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_past_its_budget_lines_are_counted_not_written(tmp_path: Path) -> None:
    path = tmp_path / "timing.jsonl"
    log = RequestTimingLog(path, max_bytes=100)
    for i in range(10):
        log.record({"id": f"chatcmpl-{i}", "pad": "x" * 20})
    log.close()
    assert path.stat().st_size <= 100
    assert log.num_written == len(path.read_text().splitlines()) >= 1
    assert log.num_written + log.num_dropped == 10
    log.record({"id": "after-close"})  # closed: counted, never raises
    assert log.num_dropped == 10 - log.num_written + 1
    with pytest.raises(ValueError):
        RequestTimingLog(path, max_bytes=0)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_stops_the_log_without_raising() -> None:
    log = RequestTimingLog("/dev/full")
    log.record({"id": "chatcmpl-a"})  # ENOSPC at the line's write
    log.record({"id": "chatcmpl-b"})
    assert (log.num_written, log.num_dropped) == (0, 2)
    log.close()


def test_off_it_writes_nothing(tmp_path: Path) -> None:
    log = NoTimingLog()
    log.record({"id": "chatcmpl-a"})
    log.close()
    assert (log.num_written, log.num_dropped, log.path) == (0, 0, None)
