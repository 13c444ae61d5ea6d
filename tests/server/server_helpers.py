"""Helpers of the HTTP server tests: real uvicorn servers on free ports, metric parsing."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

API_KEYS = ("key-alpha", "key-beta")
METRICS_KEY = "key-operator"  # /metrics: the operator's key, not a tenant's
MAX_MODEL_LEN = 512


class RunningServer:
    """A uvicorn server in a thread, on a socket bound before it starts (no port race)."""

    def __init__(self, app) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    def start(self) -> RunningServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)
        self._sock.close()

    @property
    def async_engine(self):
        return self.app.state.async_engine

    @property
    def engine(self):
        return self.app.state.async_engine.engine


def start_server(model_dir: Path, *, api_keys: tuple[str, ...] = (), max_queue: int | None = None,
                 served_model_name: str | None = None, metrics_key: str | None = None,
                 **engine_kwargs) -> RunningServer:
    """An engine on CPU behind build_app, served by uvicorn in a thread."""
    from engine import EngineConfig, LLMEngine
    from server.app import build_app
    from server.settings import ServerSettings

    fields = {"device": "cpu", "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 256,
              "max_num_seqs": 8}
    fields.update(engine_kwargs)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), **fields))
    settings = ServerSettings(served_model_name=served_model_name, api_keys=api_keys,
                              max_queue=max_queue, metrics_key=metrics_key)
    server = RunningServer(build_app(engine, settings))
    try:
        return server.start()
    except BaseException:
        engine.close()
        raise


def stop_server(server: RunningServer) -> None:
    server.stop()
    server.engine.close()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0.0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        match = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def assert_healthy(url: str, api_key: str | None = API_KEYS[0]) -> None:
    """The server answers /health and still completes a request."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2,
                                            "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
