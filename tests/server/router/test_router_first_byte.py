"""A hung engine (SIGSTOP: connected, silent) holds a streamed request at the router for at most
``--first-byte-timeout``, not ``--upstream-timeout`` (issue 37): a stream's response head leaves
a live engine when it admits the request. A whole answer (no stream) has its head only with its
last token, so only ``--upstream-timeout`` bounds it. Real engine, real router."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from daemon_helpers import wait_until
from support.kvengine import KvengineProcess
from support.router import start_router, stop_router

from server.router.app import streams

pytestmark = pytest.mark.timeout(120)

FIRST_BYTE_S = 1.0
UPSTREAM_S = 4.0


def test_a_stream_is_told_apart_by_its_body() -> None:
    assert streams(b'{"stream": true, "prompt": "a"}')
    assert not streams(b'{"stream": false}') and not streams(b'{"prompt": "a"}')
    assert not streams(b'{"prompt": "say \\"stream\\": true"}')
    assert not streams(b'{"stream": true') and not streams(b'[{"stream": true}]')


@pytest.fixture()
def hung(tiny_model_dir: Path) -> Iterator[tuple[str, KvengineProcess]]:
    engine = KvengineProcess(str(tiny_model_dir), "--no-warm-up", "--num-kv-blocks", "64",
                             env={"KVENGINE_API_KEY": None})
    lines: list[str] = []
    router = None
    try:
        router, url = start_router(tiny_model_dir, [
            "--engine", f"gpu0={engine.url}", "--probe-interval", "60", "--first-byte-timeout",
            str(FIRST_BYTE_S), "--upstream-timeout", str(UPSTREAM_S)], lines)
        assert wait_until(lambda: httpx.get(url + "/ready").status_code == 200, 30)
        answer = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1},
                            timeout=30)
        assert answer.headers["x-kvengine-engine"] == "gpu0"  # its name, not its address
        engine.proc.send_signal(signal.SIGSTOP)
        yield url, engine
    finally:
        engine.proc.send_signal(signal.SIGCONT)
        if router is not None:
            stop_router(router)
        engine.stop()


def _timed_post(url: str, body: dict) -> tuple[float, httpx.Response]:
    start = time.monotonic()
    response = httpx.post(url + "/v1/completions", json=body, timeout=30)
    return time.monotonic() - start, response


def test_a_hung_engine_holds_a_stream_for_the_first_byte_bound_only(hung) -> None:
    url, _ = hung
    waited, response = _timed_post(url, {"prompt": "a", "max_tokens": 4, "stream": True})
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "upstream_first_byte_timeout"
    assert FIRST_BYTE_S <= waited < UPSTREAM_S
    waited, response = _timed_post(url, {"prompt": "a", "max_tokens": 4})
    assert response.status_code == 504 and waited >= UPSTREAM_S - 0.1, response.text
    assert response.json()["error"]["code"] == "upstream_timeout"
