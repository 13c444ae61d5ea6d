"""Issue 21.5: /metrics showed every tenant's traffic to every tenant. With B's key, B watched
`prompt_tokens_total` and the prefix-cache hits move with each of A's requests.

Now /metrics is the operator's: with API keys it needs the metrics key (`--metrics-key` or
`KVENGINE_METRICS_KEY`), a tenant's key gets 403, and without a metrics key it is refused to all.
Without API keys (no tenants to tell apart by key) it stays open, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_process import EngineProcess, tiny_model

pytestmark = pytest.mark.timeout(180)

KEY_A, KEY_B, OPERATOR = "metrics-tenant-a", "metrics-tenant-b", "metrics-operator"


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def _metrics(engine: EngineProcess, key: str | None) -> httpx.Response:
    return httpx.get(engine.url + "/metrics", headers=_bearer(key), timeout=30)


def _prompt_tokens(text: str) -> float:
    assert "# TYPE vllm:prompt_tokens_total counter" in text or "vllm:prompt_tokens" in text
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0  # no sample before the first request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("metrics-access") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[EngineProcess]:
    running = EngineProcess(model_dir, "--api-key", KEY_A, "--api-key", KEY_B,
                            "--metrics-key", OPERATOR)
    yield running
    running.stop()


def test_tenant_b_cannot_watch_tenant_a(engine: EngineProcess) -> None:
    r = _metrics(engine, KEY_B)
    assert r.status_code == 403, r.text[:300]
    assert r.json()["error"]["code"] == "metrics_forbidden"
    assert "kvengine:" not in r.text and "vllm:" not in r.text
    for key in (None, "wrong", KEY_A + "x"):
        r = _metrics(engine, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_the_operator_sees_everyones_traffic(engine: EngineProcess) -> None:
    before = _prompt_tokens(_metrics(engine, OPERATOR).text)
    r = httpx.post(engine.url + "/v1/completions", headers=_bearer(KEY_A), timeout=60,
                   json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 1})
    assert r.status_code == 200, r.text
    after = _metrics(engine, OPERATOR)
    assert after.status_code == 200 and after.headers["content-type"].startswith("text/plain")
    assert _prompt_tokens(after.text) - before == 5


def test_with_api_keys_and_no_metrics_key_metrics_are_refused_to_all(model_dir: Path) -> None:
    running = EngineProcess(model_dir, "--api-key", KEY_A, env={"KVENGINE_METRICS_KEY": None})
    try:
        for key in (None, "anything"):
            assert _metrics(running, key).status_code == 401
        r = _metrics(running, KEY_A)
        assert r.status_code == 403 and "--metrics-key" in r.json()["error"]["message"], r.text
        assert httpx.get(running.url + "/health", timeout=10).status_code == 200
    finally:
        running.stop()


def test_the_metrics_key_can_come_from_the_environment(model_dir: Path) -> None:
    running = EngineProcess(model_dir, "--api-key", KEY_A, env={"KVENGINE_METRICS_KEY": OPERATOR})
    try:
        assert _metrics(running, OPERATOR).status_code == 200
        assert _metrics(running, KEY_A).status_code == 403
    finally:
        running.stop()


def test_without_api_keys_metrics_stay_open(model_dir: Path) -> None:
    running = EngineProcess(model_dir, env={"KVENGINE_METRICS_KEY": None})
    try:
        r = _metrics(running, None)
        assert r.status_code == 200 and "vllm:prompt_tokens_total" in r.text
    finally:
        running.stop()
