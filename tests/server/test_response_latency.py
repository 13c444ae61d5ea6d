"""Responses leave at once: the listener's sockets have TCP_NODELAY.

`kvengine serve` binds its port itself (before loading the model) and hands the socket to uvicorn;
asyncio sets TCP_NODELAY only on sockets whose protocol says TCP, so a socket made with proto 0
sent each response's body behind its headers only after the client's delayed ACK, ~40 ms later:
that was most of an HBM-hit turn's TTFT. The fastest of a few requests on one keep-alive
connection shows it whatever the machine's load.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from support.kvengine import KvengineProcess

NAGLE_STALL_MS = 40.0


def _fastest_ms(send, count: int = 5) -> float:
    elapsed = []
    for _ in range(count):
        response = send()
        assert response.status_code == 200, response.text
        elapsed.append(response.elapsed.total_seconds() * 1e3)
    return min(elapsed[1:])  # the first pays the connection's setup


def test_kvengine_serve_answers_without_a_nagle_stall(tiny_model_dir: Path) -> None:
    body = {"prompt": "a b c d", "max_tokens": 1, "temperature": 0.0}
    with KvengineProcess("--model", str(tiny_model_dir)) as served, \
            httpx.Client(base_url=served.url, timeout=30) as http:
        assert _fastest_ms(lambda: http.get("/health")) < NAGLE_STALL_MS * 0.6
        assert _fastest_ms(lambda: http.post("/v1/completions", json=body)) \
            < NAGLE_STALL_MS * 0.6
