"""/health and /metrics report the kvstore daemon's state when the engine runs with --kv-offload
(issue 21.1 asks for a hung store to be reported). The engine keeps serving by recomputing, so
/health stays 200 and says `"kv_store": "ok" | "hung" | "down"`; `kvengine:kv_store_up` is 1 or 0.

The state comes from the engine's offload stats (`store_state`); until the engine reports it the
store tests skip and say so.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from daemon_helpers import RunningDaemon
from engine_process import EngineProcess, tiny_model

pytestmark = pytest.mark.timeout(180)

STATE_BOUND_S = 30.0  # how long the offload layer may take to notice


def _kv_store_up(engine: EngineProcess) -> float | None:
    for line in httpx.get(engine.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvengine:kv_store_up{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _health(engine: EngineProcess) -> dict:
    start = time.perf_counter()
    r = httpx.get(engine.url + "/health", timeout=10)
    assert r.status_code == 200, r.text  # the engine serves whatever the store does
    assert time.perf_counter() - start < 2.0
    return r.json()


def _wait_for_state(engine: EngineProcess, wanted: Callable[[str], bool]) -> str:
    deadline = time.monotonic() + STATE_BOUND_S
    while True:
        state = _health(engine)["kv_store"]
        if wanted(state) or time.monotonic() > deadline:
            return state
        httpx.post(engine.url + "/v1/completions", timeout=60,  # store traffic to notice by
                   json={"prompt": "hello store " * 8, "max_tokens": 1})
        time.sleep(0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("health-store") / "tiny")


@pytest.fixture
def offload_engine(model_dir: Path, make_daemon) -> Iterator[tuple[EngineProcess,
                                                                    RunningDaemon]]:
    daemon = make_daemon()
    running = EngineProcess(model_dir, "--kv-offload", "--kv-store-socket",
                            str(daemon.socket_path))
    try:
        yield running, daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGCONT)
        running.stop()


def test_without_offload_health_is_plain(model_dir: Path) -> None:
    running = EngineProcess(model_dir)
    try:
        assert _health(running) == {"status": "ok"}
        assert _kv_store_up(running) is None
    finally:
        running.stop()


def test_a_hung_store_is_reported_and_serving_goes_on(offload_engine) -> None:
    engine, daemon = offload_engine
    body = _health(engine)
    if "kv_store" not in body:
        pytest.skip("the engine's offload stats carry no store_state yet (issue 21.1's engine "
                    "side); /health reports it once they do")
    assert body == {"status": "ok", "kv_store": "ok"}
    assert _kv_store_up(engine) == 1.0
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert _wait_for_state(engine, lambda s: s != "ok") in ("hung", "down")
        assert _kv_store_up(engine) == 0.0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert _wait_for_state(engine, lambda s: s == "ok") == "ok"
    assert _kv_store_up(engine) == 1.0
