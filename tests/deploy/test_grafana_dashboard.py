"""docs/deploy/grafana/kvstore.json (issue 30 item 4): every series a panel's query names is one
the programs export. The daemon's and kvengine's come from real scrapes (a daemon with an SSD
tier, an engine with --kv-offload on it, in this process), the router's from its metrics over a
pool of one engine, the vLLM connector's from the family it declares (vLLM itself is not
started here: tests/offload/test_vllm_e2e.py reads the series through vLLM)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from daemon_helpers import start_daemon

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "deploy" / "grafana" / "kvstore.json"
SERIES = re.compile(r"(?:kvstore_|vllm:|kvengine:)[A-Za-z0-9_:]*")
TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


def _names(text: str) -> set[str]:
    """Series names a scrape carries: counters as their TYPE line names them (with _total),
    histograms as _bucket, _sum and _count too."""
    out = set()
    for name, kind in TYPE_LINE.findall(text):
        out.add(name)
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return out


def _queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> set[str]:
    from fastapi.testclient import TestClient

    from engine import EngineConfig, LLMEngine
    from kvstore import StoreState
    from server.app import build_app
    from server.router.engine_pool import EnginePool
    from server.router.metrics import RouterMetrics

    work = tmp_path_factory.mktemp("grafana")
    daemon = start_daemon(work, dram="32MiB", ssd_dir=work / "ssd", ssd_size="16MiB")
    try:
        engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), device="cpu",
                                        max_model_len=256, num_kv_blocks=64, kv_offload=True,
                                        kv_store_socket=str(daemon.socket_path)))
        try:
            with TestClient(build_app(engine)) as client:
                reply = client.post("/v1/completions", json={"prompt": "hello " * 40,
                                                             "max_tokens": 2})
                assert reply.status_code == 200, reply.text
                names = _names(client.get("/metrics").text)
        finally:
            engine.close()
        names |= _names(httpx.get(daemon.http_url + "/metrics", timeout=10).text)
    finally:
        daemon.stop()
    pool = EnginePool(["http://127.0.0.1:9"], httpx.AsyncClient())
    names |= _names(RouterMetrics(pool).render(StoreState.OK).decode())
    # The connector's family, as offload/vllm/reports.py declares it to vLLM (a counter).
    declared = re.findall(r'name="(vllm:[a-z_]+)"', (ROOT / "offload" / "vllm" / "reports.py")
                          .read_text())
    assert declared == ["vllm:kvstore_events"]
    return names | {f"{name}_total" for name in declared}


def test_every_query_names_an_exported_series(exported: set[str]) -> None:
    queries = _queries()
    assert len(queries) >= 30
    unknown = sorted({(title, name) for title, expr in queries for name in SERIES.findall(expr)
                      if name not in exported})
    assert not unknown, unknown


def test_the_dashboard_covers_every_program() -> None:
    text = " ".join(expr for _, expr in _queries())
    for needle in ("kvstore_health_status", "kvstore_request_duration_seconds_bucket",
                   "vllm:time_to_first_token_seconds_bucket", "vllm:prompt_tokens_cached_by",
                   "kvengine:router_requests_total", "vllm:kvstore_events_total"):
        assert needle in text, needle
