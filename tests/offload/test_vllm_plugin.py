"""vLLM finds the connector by name (entry point ``vllm.general_plugins``), and folders named
``kvstore/`` and ``offload/`` in the working directory never replace the installed packages.

The shadowing folders are the ones users have: ``kvstore/`` holding the daemon's socket (a plain
folder) and ``offload/``, a project's own package. Processes start without this checkout on
``PYTHONPATH``, so the packages come from the install, as they would for a user.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from daemon_helpers import start_daemon, wait_until
from vllm_parts import BLOCK_SIZE, dram_blocks, prompt

from kvstore.testing.processes import stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]
FOREIGN = 'raise ImportError("a project of its own named offload")\n'


@pytest.fixture
def shadowed_dir() -> Iterator[Path]:
    """A short working directory (the socket goes inside) holding ``kvstore/`` (empty) and a
    foreign ``offload/`` package."""
    workdir = Path(tempfile.mkdtemp(prefix="kvs-"))
    (workdir / "kvstore").mkdir(mode=0o700)
    (workdir / "offload").mkdir()
    (workdir / "offload" / "__init__.py").write_text(FOREIGN)
    yield workdir
    shutil.rmtree(workdir, ignore_errors=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTHONPATH", "KVSTORE_SOCKET"):
        env.pop(name, None)
    return env


def _python(workdir: Path, code: str) -> subprocess.CompletedProcess:
    """``python -c code`` in ``workdir``: the working directory comes first on ``sys.path``."""
    return subprocess.run([sys.executable, "-c", code], cwd=workdir, env=_env(),
                          capture_output=True, text=True, timeout=60)


def test_the_install_names_the_plugin(shadowed_dir) -> None:
    done = _python(shadowed_dir, "from importlib.metadata import entry_points\n"
                                 "print([e.value for e in entry_points(group="
                                 "'vllm.general_plugins') if e.name == 'kvstore'])")
    assert done.stdout.strip() == "['kvstore_tiered_vllm:register']", done.stderr


def test_the_installed_packages_win_over_folders_of_the_same_name(shadowed_dir) -> None:
    plain = _python(shadowed_dir, "import offload")
    assert "a project of its own" in plain.stderr  # the trap is real in this directory
    done = _python(shadowed_dir, (
        "import kvstore_tiered_vllm\n"
        "kvstore_tiered_vllm.bind_packages()\n"
        "from kvstore import Client\n"
        "import offload.store_client, kvstore\n"
        "print(kvstore.__file__); print(offload.store_client.__file__)\n"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(REPO_ROOT / "kvstore" / "__init__.py"),
                                   str(REPO_ROOT / "offload" / "store_client.py")]


def test_a_foreign_module_imported_first_is_named_in_the_error(shadowed_dir) -> None:
    (shadowed_dir / "offload" / "__init__.py").write_text("")
    done = _python(shadowed_dir, "import offload, kvstore_tiered_vllm\n"
                                 "kvstore_tiered_vllm.KVStoreConnector\n")
    assert done.returncode != 0
    assert f"'offload' from {shadowed_dir}/offload" in done.stderr
    assert str(REPO_ROOT / "offload") in done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
def test_vllm_serve_finds_the_connector_by_name_from_a_shadowing_folder(shadowed_dir,
                                                                       small_model_dir) -> None:
    sock = shadowed_dir / "kvstore" / "kvstore.sock"
    daemon = start_daemon(shadowed_dir, dram="128MiB", http=False, socket_path=sock)
    port = _free_port()
    config = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"kv_store_socket": str(sock)}}
    log_path = shadowed_dir / "vllm.log"
    with open(log_path, "w") as log:
        # ``python -m``: the working directory is sys.path[0] in vLLM and every process it starts.
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(small_model_dir), "--port", str(port), "--max-model-len", "2048",
             "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
             "--kv-transfer-config", json.dumps(config)],
            cwd=shadowed_dir, env=_env(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            if server.poll() is not None:
                return True
            try:
                return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, 240.0, 0.5) and server.poll() is None, log_path.read_text()[-3000:]
        p = prompt(31, 600)
        reply = httpx.post(f"{url}/v1/completions", timeout=120.0, json={
            "model": str(small_model_dir), "prompt": p, "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        # The connector saved the prompt's full blocks: it ran, with the installed packages.
        assert wait_until(lambda: dram_blocks(daemon) >= len(p) // BLOCK_SIZE, 10.0), \
            log_path.read_text()[-3000:]
        text = log_path.read_text()
        assert "Creating v1 connector with name: KVStoreConnector" in text
        # The connector's lines go where vLLM's go (the plugin hands them vLLM's handler).
        assert f"connected to kvstore at {sock}" in text, text[-3000:]
    finally:
        stop_process(server, signal.SIGTERM, timeout_s=30)
        with contextlib.suppress(ProcessLookupError):  # its engine and workers, if left
            os.killpg(server.pid, signal.SIGKILL)
        daemon.stop()
