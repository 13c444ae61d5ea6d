"""The admin HTTP app and the `kvstore` command line, against real daemons."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from daemon_helpers import REPO_ROOT, RunningDaemon

pytestmark = pytest.mark.timeout(60)


def kvstore_cli(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


# ------------------------------------------------------------------------------- admin HTTP


def test_admin_listens_on_loopback(daemon: RunningDaemon) -> None:
    assert daemon.http_url is not None and daemon.http_url.startswith("http://127.0.0.1:")


def test_admin_health(daemon: RunningDaemon) -> None:
    r = httpx.get(f"{daemon.http_url}/health", timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["uptime_s"] >= 0 and body["pid"] == daemon.proc.pid


def test_admin_answers_without_a_nagle_stall(daemon: RunningDaemon) -> None:
    """Requests on one keep-alive connection answer in a few ms: without TCP_NODELAY each waited
    ~40 ms for the client's delayed ACK (the fastest of five shows it whatever the load)."""
    with httpx.Client(base_url=daemon.http_url, timeout=10) as http:
        elapsed_ms = []
        for _ in range(5):
            r = http.get("/health")
            assert r.status_code == 200
            elapsed_ms.append(r.elapsed.total_seconds() * 1e3)
    assert min(elapsed_ms[1:]) < 25, elapsed_ms


def test_admin_stats(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        c.put(b"admin-stats", b"x" * 5000)
        assert c.get(b"admin-stats") is not None
    r = httpx.get(f"{daemon.http_url}/stats", timeout=10)
    assert r.status_code == 200
    stats = r.json()
    for tier in ("dram", "ssd"):
        for field in ("capacity_bytes", "used_bytes", "blocks", "hits", "misses"):
            assert field in stats["tiers"][tier], (tier, field)
    assert stats["tiers"]["dram"]["capacity_bytes"] == 64 << 20
    assert stats["tiers"]["dram"]["blocks"] >= 1 and stats["tiers"]["dram"]["hits"] >= 1
    assert stats["tiers"]["dram"]["misses"] >= stats["counters"]["miss_blocks"] >= 0
    assert stats["tiers"]["ssd"]["misses"] == 0  # the shared daemon has no SSD tier
    assert stats["daemon"]["requests"]["put"] >= 1
    assert stats["daemon"]["copies"] == {}  # how GPU copiers' batches went: no GPU engine here


def test_admin_metrics(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        c.put(b"admin-metrics", b"y" * 100)
        c.get(b"admin-metrics")
        c.get(b"admin-metrics-missing")
    r = httpx.get(f"{daemon.http_url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert re.search(r'^kvstore_tier_capacity_bytes\{tier="dram"\} 6\.7108864e\+07$', text, re.M)
    assert re.search(r'^kvstore_tier_used_bytes\{tier="ssd"\} 0\.0$', text, re.M)
    assert re.search(r'^kvstore_tier_hits_total\{tier="dram"\} [1-9]', text, re.M)
    assert re.search(r'^kvstore_requests_total\{verb="get"\} [1-9]', text, re.M)
    assert re.search(r"^kvstore_store_miss_blocks_total [1-9]", text, re.M)
    assert "# TYPE kvstore_tier_blocks gauge" in text
    assert "# TYPE kvstore_copy_batches_total counter" in text  # GPU engines: packed or not


def test_admin_metrics_speak_prometheus_units(daemon: RunningDaemon) -> None:
    """Uptime in _seconds, process metrics, and a latency histogram per critical-path verb."""
    import xxhash

    from kvstore.keys import Namespace

    with daemon.client() as c:
        c.put(b"admin-latency", b"z" * 100)
        hit = c.lookup(Namespace(name="default").digest, [xxhash.xxh3_128_digest(b"admin-latency")],
                       [b"admin-latency"], lease_ttl_s=0)
        assert hit.num_hit == 1
    text = httpx.get(f"{daemon.http_url}/metrics", timeout=10).text
    assert re.search(r"^kvstore_uptime_seconds \d", text, re.M)
    assert "kvstore_uptime_s " not in text
    assert re.search(r"^process_cpu_seconds_total \d", text, re.M)
    assert re.search(r"^process_resident_memory_bytes \d", text, re.M)
    assert "# TYPE kvstore_request_duration_seconds histogram" in text
    count = re.search(r'^kvstore_request_duration_seconds_count\{verb="lookup"\} (\S+)$', text,
                      re.M)
    assert count is not None and float(count.group(1)) >= 1
    for verb in ("load", "save"):
        assert f'kvstore_request_duration_seconds_bucket{{le="+Inf",verb="{verb}"}}' in text


def test_admin_unknown_path(daemon: RunningDaemon) -> None:
    assert httpx.get(f"{daemon.http_url}/nope", timeout=10).status_code == 404


# --------------------------------------------------------------------------------------- CLI


def test_startup_banner(daemon: RunningDaemon) -> None:
    banner = "\n".join(daemon.lines)
    assert "DRAM pool 64.0 MiB (67108864 bytes), pinned: no" in banner
    assert "SSD tier off" in banner
    assert f"listening on {daemon.socket_path} (control socket)" in banner
    assert f"admin HTTP {daemon.http_url}" in banner


def test_startup_banner_with_ssd(make_daemon, tmp_path: Path) -> None:
    running = make_daemon(dram="8MiB", ssd_dir=tmp_path / "ssd", ssd_size="32MiB", http=False)
    banner = "\n".join(running.lines)
    assert f"SSD tier {tmp_path / 'ssd'}, 32.0 MiB, IO mode " in banner
    assert re.search(r"IO mode (direct|buffered)", banner)
    assert "admin HTTP off" in banner


def test_stats_json_over_socket(daemon: RunningDaemon) -> None:
    out = kvstore_cli("stats", "--socket", str(daemon.socket_path), "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert set(stats["tiers"]) >= {"dram", "ssd"}
    assert stats["daemon"]["connections"] >= 1


def test_stats_table_over_http(daemon: RunningDaemon) -> None:
    out = kvstore_cli("stats", "--http", daemon.http_url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["tier", "capacity", "used", "blocks", "hits", "misses"]
    assert lines[1].split()[:3] == ["dram", "64.0", "MiB"]
    assert lines[2].split()[0] == "ssd"
    assert any(line.startswith("daemon: uptime") for line in lines)
    assert any(line.startswith("requests: ") for line in lines)


def test_stats_without_a_daemon(tmp_path: Path) -> None:
    out = kvstore_cli("stats", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1
    assert "not reachable" in out.stderr and "Traceback" not in out.stderr
    out = kvstore_cli("stats", "--http", "http://127.0.0.1:9")
    assert out.returncode == 1 and "cannot read stats" in out.stderr


CLI_ERRORS = [
    (["serve", "--dram", "12XB"], 2, "invalid size '12XB': unknown unit 'XB'"),
    (["serve", "--dram", "lots"], 2, "argument --dram: invalid size 'lots'"),
    (["serve", "--ssd-size", "1.5"], 2, "a byte count must be a whole number"),
    (["serve", "--dram", "0"], 2, "--dram must be larger than 0"),
    (["serve", "--ssd-size", "1GiB"], 2, "--ssd-size needs --ssd-dir"),
    (["serve", "--http", "nowhere"], 2, "--http: expected HOST:PORT"),
    (["serve", "--cluster", "redis://127.0.0.1/0"], 2, "--cluster must name HOST and PORT"),
    (["serve", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["serve", "--eviction", "random"], 2, "invalid choice"),
    (["frobnicate"], 2, "invalid choice"),
]


@pytest.mark.parametrize(("args", "code", "needle"), CLI_ERRORS)
def test_cli_errors(args: list[str], code: int, needle: str,
                    capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli.command import main

    try:
        returned = main(args)
    except SystemExit as exc:  # argparse's own errors
        returned = exc.code
    err = capsys.readouterr().err
    assert returned == code, err
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("index", [0, 6, 7])
def test_cli_errors_as_a_process(index: int) -> None:
    args, code, needle = CLI_ERRORS[index]
    out = kvstore_cli(*args)
    assert out.returncode == code, (out.stdout, out.stderr)
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_cli_bad_ssd_dir(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    out = kvstore_cli("serve", "--ssd-dir", str(a_file), "--ssd-size", "1MiB")
    assert out.returncode == 2 and "is not a directory" in out.stderr
    out = kvstore_cli("serve", "--ssd-dir", str(a_file / "sub"), "--ssd-size", "1MiB")
    assert out.returncode == 2 and "is not usable" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_cli_busy_http_port(daemon: RunningDaemon, tmp_path: Path) -> None:
    port = daemon.http_url.rsplit(":", 1)[1]
    sock_dir = tmp_path / "s"
    out = kvstore_cli("serve", "--socket", str(sock_dir / "kv.sock"), "--dram", "4MiB",
                      "--http", f"127.0.0.1:{port}")
    assert out.returncode == 1 and "cannot listen for HTTP" in out.stderr
    assert "Traceback" not in out.stderr


def test_console_script_entry_point() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "kvstore"]
    assert ep.value == "kvstore.cli:main"
    from kvstore.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--dram", "nope"])
    assert info.value.code == 2
