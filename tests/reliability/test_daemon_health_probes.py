"""Issue 32 item 6: the daemon's ``/health`` is not a constant. A wedged control loop, a read-only
SSD and Redis stopped each show in ``/health`` within a second, and in ``/metrics``; ``/ready``
says whether the daemon serves.

The wedge: ``KVSTORE_DEBUG_STALL_ON_SIGUSR2`` (tests only, off by default) makes SIGUSR2 block the
control loop with a synchronous sleep, as a slow call on the loop would; the admin thread goes on
answering. SIGSTOP would stop the whole process, the probe included.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from daemon_helpers import RunningDaemon
from readonly_disk import ext4_mount, make_read_only

from kvstore.testing.processes import stop_process

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvstore" / "cluster"))
from cluster_parts import RedisServer, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(120)

WITHIN_S = 1.0
STALL_S = 3.0


def _health(daemon: RunningDaemon) -> httpx.Response:
    return httpx.get(daemon.http_url + "/health", timeout=5.0)


def _metric(daemon: RunningDaemon, series: str) -> float:
    for line in httpx.get(daemon.http_url + "/metrics", timeout=5.0).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} is not on /metrics")


def _seconds_until(daemon: RunningDaemon, predicate, limit_s: float = 5.0) -> float:
    """Seconds until ``/health``'s body satisfies ``predicate`` (polled every 20 ms)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if predicate(_health(daemon).json()):
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"/health never changed: {_health(daemon).json()}")


def test_a_wedged_control_loop_fails_health_and_readiness(make_daemon) -> None:
    daemon = make_daemon(http=True, env={"KVSTORE_DEBUG_STALL_ON_SIGUSR2": str(STALL_S)})
    r = _health(daemon)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert r.json()["control_loop"]["state"] == "ok"
    assert httpx.get(daemon.http_url + "/ready", timeout=5.0).status_code == 200
    assert _metric(daemon, "kvstore_control_loop_stalled") == 0.0

    os.kill(daemon.proc.pid, signal.SIGUSR2)
    took = _seconds_until(daemon, lambda body: body["status"] == "failing")
    assert took <= WITHIN_S
    r = _health(daemon)
    assert r.status_code == 503
    assert r.json()["control_loop"]["state"] == "stalled"
    assert any("control loop" in p for p in r.json()["problems"])
    ready = httpx.get(daemon.http_url + "/ready", timeout=5.0)
    assert ready.status_code == 503 and not ready.json()["ready"]
    assert _metric(daemon, "kvstore_control_loop_stalled") == 1.0
    assert _metric(daemon, 'kvstore_health_status{status="failing"}') == 1.0
    assert _metric(daemon, "kvstore_control_loop_last_tick_age_seconds") > 0.5

    _seconds_until(daemon, lambda body: body["status"] == "ok", STALL_S + 5.0)  # it recovers
    assert httpx.get(daemon.http_url + "/ready", timeout=5.0).status_code == 200
    with daemon.client() as c:
        assert c.health()["status"] == "ok"


def test_a_stalled_loop_and_the_collectors_pauses_are_counted_in_stats(make_daemon) -> None:
    """What made a reply late shows afterwards: the loop's lateness (counted, logged), the
    garbage collector's pauses (every collection timed) and every thread's stack, written to a
    file beside the socket by faulthandler's watchdog while the loop was held."""
    daemon = make_daemon(http=False, env={"KVSTORE_DEBUG_STALL_ON_SIGUSR2": "0.8",
                                          "KVSTORE_DEBUG_STALL_STACKS": "1"})
    with daemon.client() as c:
        before = c.stats()["daemon"]["stalls"]
        os.kill(daemon.proc.pid, signal.SIGUSR2)
        time.sleep(1.2)
        for _ in range(1500):  # objects the store keeps (entries): the collector runs
            c.put(os.urandom(8), os.urandom(64))
        after = c.stats()["daemon"]["stalls"]
    assert after["loop_lags_long"] >= before["loop_lags_long"] + 1
    assert 600 <= after["loop_lag_ms_max"] < 5000  # the stall less what was left of a tick
    assert sum(after["gc_collections"]) > 0 and after["gc_ms_total"] > 0
    assert after["gc_ms_max"] <= after["gc_ms_total"]
    assert any("control loop ran" in line and "ms late" in line for line in daemon.lines)
    assert after["stack_dumps"] >= before["stack_dumps"] + 1
    stacks = Path(after["stack_file"])
    assert stacks.parent == daemon.socket_path.parent
    assert "most recent call first" in stacks.read_text()
    assert any(str(stacks) in line for line in daemon.lines)
    assert stop_process(daemon.proc) == 0  # the daemon alone (its fixture removes the dir)
    assert stacks.exists()  # kept: it has what the operator needs


def test_stack_dumps_are_asked_for_and_leave_nothing_when_the_loop_never_stalled(
        make_daemon) -> None:
    plain = make_daemon(http=False)
    with plain.client() as c:
        assert c.stats()["daemon"]["stalls"]["stack_file"] is None  # off by default
    daemon = make_daemon(http=False, env={"KVSTORE_DEBUG_STALL_STACKS": "1"})
    with daemon.client() as c:
        path = c.stats()["daemon"]["stalls"]["stack_file"]
    assert path is not None and Path(path).exists()
    assert stop_process(daemon.proc) == 0
    assert not Path(path).exists() and daemon.socket_path.parent.exists()


def test_the_stall_hook_is_off_by_default(make_daemon) -> None:
    daemon = make_daemon(http=True)
    # Without the variable SIGUSR2 keeps its default action: the process ends (nothing of the
    # test hook is installed in a daemon started normally).
    os.kill(daemon.proc.pid, signal.SIGUSR2)
    assert daemon.proc.wait(10) == -signal.SIGUSR2


def test_a_read_only_ssd_degrades_health(make_daemon, tmp_path: Path) -> None:
    with ext4_mount(tmp_path) as mnt:
        daemon = make_daemon(http=True, ssd_dir=mnt / "ssd", ssd_size="16MiB")
        body = _health(daemon).json()
        assert body["status"] == "ok" and body["ssd"]["state"] == "ok", body
        make_read_only(mnt)
        took = _seconds_until(daemon, lambda body: body["ssd"]["state"] == "read_only")
        assert took <= WITHIN_S
        r = _health(daemon)
        assert r.status_code == 200  # still serving, from DRAM
        assert r.json()["status"] == "degraded"
        assert "read-only" in r.json()["ssd"]["reason"], r.text
        assert _metric(daemon, 'kvstore_ssd_state{state="read_only"}') == 1.0
        assert _metric(daemon, 'kvstore_ssd_state{state="ok"}') == 0.0
        assert _metric(daemon, 'kvstore_health_status{status="degraded"}') == 1.0
        daemon.stop()


def test_a_truncated_ssd_data_file_degrades_health(make_daemon, tmp_path: Path) -> None:
    """Attacked from outside (2026-11-28): a data file cut short left /health ``ok``; the blocks
    past its end are gone (their reads miss). Now the ssd component says so."""
    daemon = make_daemon(http=True, ssd_dir=tmp_path / "ssd", ssd_size="16MiB")
    assert _health(daemon).json()["ssd"]["state"] == "ok"
    data = sorted((tmp_path / "ssd").glob("data-*.bin"))[0]
    os.truncate(data, 4096)
    took = _seconds_until(daemon, lambda body: body["ssd"]["state"] == "damaged")
    assert took <= WITHIN_S
    r = _health(daemon)
    assert r.status_code == 200 and r.json()["status"] == "degraded"
    assert "truncated" in r.json()["ssd"]["reason"] and data.name in r.json()["ssd"]["reason"]
    assert _metric(daemon, 'kvstore_ssd_state{state="damaged"}') == 1.0
    daemon.stop()


@pytest.mark.cluster
def test_redis_stopped_degrades_health(make_daemon, tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    try:
        daemon = make_daemon("--cluster", redis_server.url, "--node-id", "probe-a",
                             "--listen", f"127.0.0.1:{free_port()}", http=True)
        body = _health(daemon).json()
        assert body["status"] == "ok" and body["redis"]["state"] == "up", body
        assert _metric(daemon, "kvstore_redis_up") == 1.0
        redis_server.stop()
        took = _seconds_until(daemon, lambda body: body["redis"]["state"] == "down")
        assert took <= WITHIN_S
        r = _health(daemon)
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
        assert _metric(daemon, "kvstore_redis_up") == 0.0
        assert _metric(daemon, "kvstore_cluster_index_up") == 0.0
        redis_server.start()  # on the same port: the index reconnects by its heartbeat
        _seconds_until(daemon, lambda body: body["redis"]["state"] == "up", 15.0)
    finally:
        redis_server.stop()
