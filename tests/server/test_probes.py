"""kvengine's probes (issue 30 item 5): ``/ready`` (serving: loaded, warmed, stepping), vLLM's
``/ping`` (GET and POST, /health's answer) and ``/health``, all without an API key; a stopped
step loop turns each to 503."""

from __future__ import annotations

from pathlib import Path

import httpx
from server_helpers import API_KEYS, start_server, stop_server


def test_probes_answer_without_a_key_and_follow_the_step_loop(tiny_model_dir: Path) -> None:
    server = start_server(tiny_model_dir, api_keys=API_KEYS)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:  # no Authorization header
            r = c.get("/ready")
            assert r.status_code == 200 and r.json() == {"ready": True, "reason": "serving"}
            assert c.get("/ping").status_code == 200
            assert c.get("/ping").json()["status"] == "ok"
            assert c.post("/ping").json()["status"] == "ok"
            assert c.get("/health").status_code == 200
            assert c.get("/v1/models").status_code == 401  # the API itself keeps its keys
            server.async_engine.stop()
            r = c.get("/ready")
            assert r.status_code == 503 and not r.json()["ready"], r.text
            assert "not running" in r.json()["reason"]
            assert c.get("/ping").status_code == c.post("/ping").status_code == 503
    finally:
        stop_server(server)


def test_the_schema_names_the_probes(tiny_model_dir: Path) -> None:
    server = start_server(tiny_model_dir)
    try:
        paths = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
        assert {"get"} <= set(paths["/ready"]) and {"get", "post"} <= set(paths["/ping"])
    finally:
        stop_server(server)
