"""docs/deploy/ (issue 30 item 8): the systemd unit passes `systemd-analyze verify` (where
systemd is installed) and its command line is the daemon's; the Kubernetes sidecar example
parses as YAML, both containers share the socket folder and one uid, and its command lines and
the daemon's config file are accepted by the programs' own parsers. Neither was run on a real
systemd host or cluster here."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from daemon_helpers import start_daemon

from kvstore.cli.args import expand_sources, subcommand
from kvstore.cli.command import build_parser as kvstore_parser
from server.cli import build_parser as kvengine_parser

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy"
UNIT = DEPLOY / "systemd" / "kvstore.service"
SIDECAR = DEPLOY / "kubernetes" / "kvstore-sidecar.yaml"


def _exec_start() -> list[str]:
    (line,) = [line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    exe = shutil.which("kvstore")
    if exe is None:
        pytest.skip("the kvstore console script is not installed")
    unit = tmp_path / "kvstore.service"  # the installed script where the unit expects it
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/kvstore", exe))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_the_units_command_line_is_the_daemons() -> None:
    argv = _exec_start()
    assert argv[0].endswith("/kvstore") and argv[1] == "serve"
    args = kvstore_parser().parse_args(argv[1:])
    assert str(args.socket) == "/run/kvstore/kvstore.sock"
    text = UNIT.read_text()
    assert "RuntimeDirectory=kvstore" in text and "RuntimeDirectoryMode=0700" in text


def _pod() -> tuple[dict, dict]:
    docs = list(yaml.safe_load_all(SIDECAR.read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Deployment", "Service"]
    return docs[0], docs[1]["spec"]["template"]["spec"]


def test_the_sidecar_shares_the_socket_folder_and_one_uid() -> None:
    config_map, pod = _pod()
    config = yaml.safe_load(config_map["data"]["kvstore.yaml"])
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"kvstore", "engine"}
    mounts = {name: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for name, c in containers.items()}
    socket_dir = mounts["kvstore"]["kvstore-socket"]
    assert mounts["engine"]["kvstore-socket"] == socket_dir
    socket = Path(config["socket"])
    assert socket.parent.parent == Path(socket_dir)  # a folder of its own under the emptyDir
    engine_cmd = containers["engine"]["command"]
    assert engine_cmd[engine_cmd.index("--kv-store-socket") + 1] == str(socket)
    assert pod["securityContext"]["runAsUser"] and not any(
        "runAsUser" in c.get("securityContext", {}) for c in containers.values())
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["dshm"]["emptyDir"]["sizeLimit"]
    assert mounts["engine"]["dshm"] == "/dev/shm"
    daemon = containers["kvstore"]
    assert daemon["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert daemon["livenessProbe"]["httpGet"]["path"] == "/health"


def test_the_sidecars_command_lines_and_config_are_accepted(tmp_path: Path) -> None:
    config_map, pod = _pod()
    containers = {c["name"]: c for c in pod["containers"]}
    config_file = tmp_path / "kvstore.yaml"
    config_file.write_text(config_map["data"]["kvstore.yaml"])
    cmd = containers["kvstore"]["command"]
    assert cmd[:2] == ["kvstore", "serve"]
    parser = kvstore_parser()
    argv = [str(config_file) if a == "/etc/kvstore/kvstore.yaml" else a for a in cmd[2:]]
    args = parser.parse_args(["serve", *expand_sources(subcommand(parser, "serve"), argv,
                                                       "KVSTORE_", {})])
    assert args.dram == 32 << 30 and args.http == "0.0.0.0:8791" and args.log_format == "json"
    engine = containers["engine"]["command"]
    assert engine[:2] == ["kvengine", "serve"]
    served = kvengine_parser().parse_args(engine[1:])
    assert served.kv_offload and served.log_format == "json"


def test_a_socket_folder_under_an_open_emptydir_is_accepted(tmp_path: Path) -> None:
    """An emptyDir's root is world-writable; the daemon's folder inside it is its own."""
    root = Path(tempfile.mkdtemp(prefix="kvs-"))
    os.chmod(root, 0o777)
    daemon = start_daemon(tmp_path, http=False, socket_path=root / "daemon" / "kvstore.sock")
    try:
        assert (root / "daemon").stat().st_mode & 0o777 == 0o700
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_the_units_user_comes_from_sysusers(tmp_path: Path) -> None:
    """kvstore.sysusers.conf creates the unit's User= and Group= and the clients' group."""
    conf = UNIT.parent / "kvstore.sysusers.conf"
    lines = [ln.split() for ln in conf.read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0][:2] == ["u", "kvstore"] and ["g", "kvstore-clients", "-"] in lines
    text = UNIT.read_text()
    assert "User=kvstore" in text and "Group=kvstore" in text
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("systemd-sysusers is not installed")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    out = subprocess.run(["systemd-sysusers", f"--root={root}", str(conf)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kvstore:" in (root / "etc" / "passwd").read_text()
    assert "kvstore-clients:" in (root / "etc" / "group").read_text()
