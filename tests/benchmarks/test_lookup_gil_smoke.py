"""benchmarks.lookup_gil for a moment: lookups are timed beside a busy thread of this process,
beside a daemon kept busy saving, and right behind their own connection's save, each daemon
started with the switch interval asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import lookup_gil

pytestmark = pytest.mark.timeout(90)


def test_lookup_gil_smoke(tmp_path: Path) -> None:
    assert lookup_gil.main(["--rounds", "1", "--seconds", "0.5", "--blocks", "64",
                            "--save-blocks", "32", "--intervals-ms", "5,0.5",
                            "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("lookup_gil-engine-daemon-*.json")
    result = json.loads(path.read_text())
    assert "--seconds 0.5" in result["command"]
    kinds = [(row["busy"], row["switch_interval_ms"]) for row in result["rows"]]
    assert kinds == [("none", 5.0), ("engine_thread", 5.0), ("engine_thread", 0.5),
                     ("daemon_saves", 5.0), ("daemon_saves", 0.5)]
    assert all(row["n"] > 0 and row["p50_ms"] > 0 for row in result["rows"])
    assert all(row["saves_per_s"] > 0 for row in result["rows"] if row["busy"] == "daemon_saves")


def test_lookup_gil_times_lookups_behind_their_own_save(tmp_path: Path) -> None:
    assert lookup_gil.main(["--busy", "own-save", "--rounds", "1", "--seconds", "0.5",
                            "--blocks", "37", "--save-blocks", "17", "--intervals-ms", "0.5",
                            "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("lookup_gil-own-save-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["busy"] for row in rows] == ["none_same_connection", "own_save"]
    assert rows[0]["n"] == rows[1]["n"] > 0 and all(row["p50_ms"] > 0 for row in rows)


def test_lookup_gil_refuses_an_unknown_busy_kind(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        lookup_gil.main(["--busy", "gpu", "--out", str(tmp_path)])
