"""docs/deploy/kubernetes/vllm-kvstore.yaml (issue 38 item 5): vLLM's image and the kvstore
daemon in one pod. It parses; the two containers share the socket folder, /dev/shm, the GPU
claim and one uid; the daemon is a native sidecar whose command line and config the daemon's
parser accepts; vLLM's command line is accepted by vLLM's own parser and its
kv_connector_extra_config by the connector; the init container's install, run here into a
folder, gives vLLM the connector by name. Not run on a cluster."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvstore.cli.args import expand_sources, subcommand
from kvstore.cli.command import build_parser as kvstore_parser
from offload.vllm.settings import check_extra_config

REPO = Path(__file__).resolve().parents[2]
POD = REPO / "docs" / "deploy" / "kubernetes" / "vllm-kvstore.yaml"


def _docs() -> list[dict]:
    return list(yaml.safe_load_all(POD.read_text()))


def _pod() -> dict:
    docs = _docs()
    assert [d["kind"] for d in docs] == ["ConfigMap", "ResourceClaimTemplate", "Deployment",
                                        "Service"]
    return docs[2]["spec"]["template"]["spec"]


def _daemon_config() -> dict:
    return yaml.safe_load(_docs()[0]["data"]["kvstore.yaml"])


def _containers() -> dict[str, dict]:
    pod = _pod()
    return {c["name"]: c for c in pod["initContainers"] + pod["containers"]}


def _mounts(container: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container["volumeMounts"]}


def _vllm_args() -> list[str]:
    vllm = _containers()["vllm"]
    assert vllm["command"] == ["vllm", "serve"]
    return vllm["args"]


def _extra_config() -> dict:
    args = _vllm_args()
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVStoreConnector" and config["kv_role"] == "kv_both"
    return config["kv_connector_extra_config"]


def test_the_daemon_is_a_sidecar_sharing_socket_shm_gpu_and_uid() -> None:
    pod = _pod()
    containers = _containers()
    assert [c["name"] for c in pod["initContainers"]] == ["install-kvstore-tiered", "kvstore"]
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    daemon, vllm = containers["kvstore"], containers["vllm"]
    assert daemon["restartPolicy"] == "Always"  # a native sidecar: up before vLLM starts
    assert "restartPolicy" not in containers["install-kvstore-tiered"]
    socket = Path(_daemon_config()["socket"])
    socket_dir = _mounts(daemon)["kvstore-socket"]
    assert _mounts(vllm)["kvstore-socket"] == socket_dir
    assert socket.parent.parent == Path(socket_dir)  # a folder of its own in the emptyDir
    assert _extra_config()["kv_store_socket"] == str(socket)
    assert _mounts(daemon)["dshm"] == _mounts(vllm)["dshm"] == "/dev/shm"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kvstore-socket"]["emptyDir"]["medium"] == "Memory"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    (claim,) = pod["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == _docs()[1]["metadata"]["name"]
    for c in (daemon, vllm):
        assert c["resources"]["claims"] == [{"name": claim["name"]}]
    security = pod["securityContext"]
    assert security["runAsUser"] and security["runAsNonRoot"]
    assert not any("runAsUser" in c.get("securityContext", {}) for c in containers.values())


def test_the_probes_are_vllms_and_the_daemons_health() -> None:
    containers = _containers()
    daemon, vllm = containers["kvstore"], containers["vllm"]
    ports = {p["name"]: p["containerPort"] for c in (daemon, vllm) for p in c["ports"]}
    assert daemon["livenessProbe"]["httpGet"] == {"path": "/health", "port": "kvstore-admin"}
    assert daemon["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert daemon["startupProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert ports["http"] == 8000 and "--port=8000" in _vllm_args()
    assert ports["kvstore-admin"] == int(_daemon_config()["http"].rsplit(":", 1)[1])
    service = _docs()[3]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]  # admin stays out


def test_the_daemons_command_line_and_config_are_accepted(tmp_path: Path) -> None:
    config_map = _docs()[0]
    daemon = _containers()["kvstore"]
    config_file = tmp_path / "kvstore.yaml"
    config_file.write_text(config_map["data"]["kvstore.yaml"])
    cmd = daemon["command"]
    assert cmd[:2] == ["kvstore", "serve"]
    parser = kvstore_parser()
    argv = [str(config_file) if a == "/etc/kvstore/kvstore.yaml" else a for a in cmd[2:]]
    args = parser.parse_args(["serve", *expand_sources(subcommand(parser, "serve"), argv,
                                                       "KVSTORE_", {})])
    assert args.dram == 48 << 30 and args.http == "0.0.0.0:8791"
    pool_gib = args.dram >> 30
    memory = daemon["resources"]["requests"]["memory"]
    assert memory.endswith("Gi") and int(memory[:-2]) > pool_gib  # the pool fits its request


def test_the_connector_accepts_its_extra_config() -> None:
    settings = check_extra_config(_extra_config())
    assert settings.kv_store_socket == _daemon_config()["socket"]


def test_vllm_has_the_installed_package_on_its_path() -> None:
    containers = _containers()
    install, vllm = containers["install-kvstore-tiered"], containers["vllm"]
    assert install["image"] == vllm["image"] and vllm["image"].startswith(
        "docker.io/vllm/vllm-openai:")  # vLLM's own Python installs it
    target = _mounts(install)["kvstore-tiered"]
    assert f"--target {target}" in install["args"][0]
    assert _mounts(vllm)["kvstore-tiered"] == target
    env = {e["name"]: e["value"] for e in vllm["env"]}
    assert env["PYTHONPATH"] == target


@pytest.mark.vllm
def test_vllms_parser_accepts_the_command_line() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    args = parser.parse_args(["serve", *_vllm_args()])
    assert args.model_tag == "/models/Qwen3-4B" and args.port == 8000
    args.model = args.model_tag
    engine = AsyncEngineArgs.from_cli_args(args)
    config = engine.kv_transfer_config
    assert config.kv_connector == "KVStoreConnector"
    assert config.kv_load_failure_policy == "recompute"
    assert config.kv_connector_extra_config == _extra_config()


@pytest.mark.vllm
@pytest.mark.slow
def test_the_init_containers_install_gives_vllm_the_connector(tmp_path: Path) -> None:
    """The install step as written (this checkout instead of the release from the index, the
    target under tmp_path); then a Python with that folder on PYTHONPATH, as vLLM's container
    has it, finds the connector by name through vLLM's plugin and loads it from that folder."""
    src = tmp_path / "src"
    for name in ("kvstore", "offload", "engine", "kernels", "server"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE", "kvstore_tiered_vllm.py"):
        shutil.copy2(REPO / name, src / name)
    install = _containers()["install-kvstore-tiered"]
    target = _mounts(install)["kvstore-tiered"]
    command = install["args"][0]
    assert '"kvstore-tiered==0.1.0"' in command
    folder = tmp_path / "opt"
    command = command.replace('"kvstore-tiered==0.1.0"', shlex.quote(str(src)))
    command = command.replace("python3 -m pip", f"{shlex.quote(sys.executable)} -m pip")
    command = command.replace(target, str(folder))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVSTORE_SOCKET")}
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert {"kvstore", "offload", "kvstore_tiered_vllm.py"} <= {p.name for p in folder.iterdir()}
    assert not {"engine", "kernels", "server"} & {p.name for p in folder.iterdir()}
    probe = (
        "import inspect\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "load_general_plugins()\n"
        f"extra = {_extra_config()!r}\n"
        "config = KVTransferConfig(kv_connector='KVStoreConnector', kv_role='kv_both',\n"
        "                          kv_connector_extra_config=extra)\n"
        "print(inspect.getfile(KVConnectorFactory.get_connector_class(config)))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(folder)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == str(folder / "offload" / "vllm" /
                                                       "connector.py")
