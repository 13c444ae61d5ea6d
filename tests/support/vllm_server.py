"""A real vLLM OpenAI server (``vllm.entrypoints.openai.api_server``) with the kvstore connector
and its KV event publisher, in its own process, for the router's tests: started, waited for
until its /health answers, stopped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvstore.testing.processes import stop_process
from kvstore.testing.vllm_process import SOURCE_ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``vllm serve MODEL`` on a free port, the connector on ``socket_path``, KV events on a
    PUB endpoint with a replay socket (``events`` / ``replay``, as a subscriber connects)."""

    def __init__(self, model_dir: Path, socket_path: Path, log: Path) -> None:
        self.port, pub, replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        transfer = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"kv_store_socket": str(socket_path),
                                                  "retry_interval_s": 1.0}}
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model_dir), "--port", str(self.port), "--host", "127.0.0.1",
                "--max-model-len", "4096", "--enforce-eager", "--seed", "0",
                "--kv-cache-memory-bytes", str(64 << 20), "--max-num-batched-tokens", "4096",
                "--kv-transfer-config", json.dumps(transfer),
                "--kv-events-config", json.dumps(events)]
        path = os.pathsep.join([str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path}
        env.pop("KVSTORE_SOCKET", None)
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     cwd=SOURCE_ROOT, env=env)

    def wait_ready(self, timeout_s: float = 300.0) -> VllmServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM at {self.url} did not come up:\n"
                           + "".join(self.log.read_text().splitlines(True)[-40:]))

    def stop(self) -> None:
        stop_process(self.proc)
        self._log_file.close()
