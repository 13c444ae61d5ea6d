"""benchmarks.soak.daemon for a few seconds: the churn runs against a real daemon (block and bytes
workers, a client killed mid-work), the samples are taken, and the JSON has its verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.soak import daemon

pytestmark = pytest.mark.timeout(90)


def test_soak_smoke(tmp_path: Path) -> None:
    rc = daemon.main(["--minutes", "0.08", "--sample-s", "1", "--kill-every", "1",
                     "--lease-ttl", "1", "--dram", "4MiB", "--ssd-size", "6MiB",
                     "--machine", "smoke", "--out", str(tmp_path)])
    [path] = tmp_path.glob("soak-smoke-*.json")
    result = json.loads(path.read_text())
    assert {"machine", "date", "command", "config", "samples", "final", "verdict"} <= set(result)
    assert result["machine"] == "smoke" and "--minutes 0.08" in result["command"]
    samples = result["samples"]
    assert len(samples) >= 4
    assert all(s["rss_bytes"] > 0 for s in samples)
    assert max(s["dram_used_bytes"] for s in samples) > 0.5 * result["config"]["dram_bytes"]
    ops = result["ops"]
    # Every kind of churn ran: lookups hit and missed, loads verified, bytes verified, the SSD
    # took demoted blocks, and at least one client died mid-work.
    assert ops["lookups"] > 10 and ops["saved_blocks"] > 0 and ops["loaded_blocks"] > 0
    assert ops["puts"] > 0 and ops["get_hits"] > 0 and ops["clients_killed"] >= 2
    assert max(s["ssd_blocks"] for s in samples) > 0
    checks = result["verdict"]["checks"]
    # Five seconds is all warm-up: RSS and pool-use drift are judged by the long run only.
    for name in ("daemon_alive", "no_wrong_bytes", "no_lost_daemon", "baseline_after_churn"):
        assert checks[name], (name, result["final"], ops)
    assert rc == (0 if result["verdict"]["flat"] else 1)
