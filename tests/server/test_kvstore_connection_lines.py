"""`kvengine serve --kv-offload` says where its store is (issue 30 item 7): "connected to kvstore
at SOCKET" at the default log level, and "reconnected to kvstore at SOCKET" after the daemon came
back. A real daemon, restarted on the same socket, and a real engine process."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from daemon_helpers import start_daemon, wait_until
from support.kvengine import KvengineProcess


def test_the_engine_logs_its_connection_and_reconnection(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, http=False)
    sock = daemon.socket_path
    try:
        with KvengineProcess(str(tiny_model_dir), "--kv-offload", "--kv-store-socket", str(sock),
                             "--max-model-len", "256") as served:
            assert wait_until(lambda: f"connected to kvstore at {sock}" in served.tail(200),
                              10.0), served.tail()
            daemon.stop()
            daemon = start_daemon(tmp_path, http=False, socket_path=sock)

            def reconnected() -> bool:
                httpx.post(served.url + "/v1/completions", timeout=60, json={
                    "prompt": f"hello {time.monotonic()}", "max_tokens": 1})
                return f"reconnected to kvstore at {sock}" in served.tail(200)

            assert wait_until(reconnected, 30.0, 0.5), served.tail()
    finally:
        daemon.stop()
