"""vLLM's HTTP series on the engine's /metrics (issue 38 item 4): ``http_requests_total`` by
handler (the route's template, ``none`` for unmatched paths), method and status class, and
``http_request_duration_seconds``; a scan of random paths or methods adds no series."""

from __future__ import annotations

import re
import uuid

import httpx
from server_helpers import API_KEYS, METRICS_KEY, RunningServer

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}


def _total(text: str, name: str, labels: dict[str, str]) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels`` (other tests on the
    shared server add series of their own)."""
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _metrics(server: RunningServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {METRICS_KEY}"}).text


def test_requests_are_counted_by_route_method_and_status_class(server: RunningServer) -> None:
    chat = {"handler": "/v1/chat/completions", "method": "POST"}
    before = _metrics(server)
    ok = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200
    assert httpx.post(server.url + "/v1/chat/completions", timeout=10,
                      json={}).status_code == 401  # no key: refused before the body
    for _ in range(3):
        httpx.get(f"{server.url}/no/such/{uuid.uuid4().hex}", headers=AUTH, timeout=10)
    httpx.request("TRACE", server.url + "/v1/models", headers=AUTH, timeout=10)  # odd, parseable
    after = _metrics(server)

    def grew(name: str, **labels: str) -> float:
        return _total(after, name, labels) - _total(before, name, labels)

    assert grew("http_requests_total", status="2xx", **chat) == 1
    assert grew("http_requests_total", status="4xx", **chat) == 1
    assert grew("http_requests_total", handler="none", method="GET", status="4xx") == 3
    assert grew("http_requests_total", method="other") == 1
    assert grew("http_request_duration_seconds_count", **chat) == 2
    assert "/no/such" not in after and "TRACE" not in after
