"""Fixtures for the HTTP server tests: a shared real server on the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import API_KEYS, METRICS_KEY, RunningServer, start_server, stop_server
from support.kvengine import KvengineProcess


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """The shared server: two API keys (two tenants), an operator key for /metrics,
    max_model_len 512."""
    running = start_server(tiny_model_dir, api_keys=API_KEYS, served_model_name="tiny",
                           metrics_key=METRICS_KEY)
    yield running
    stop_server(running)


@pytest.fixture()
def http(server: RunningServer) -> Iterator[httpx.Client]:
    """An httpx client on the shared server, authenticated with the first key."""
    headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client


@pytest.fixture()
def client(server: RunningServer):
    """A stock OpenAI client on the shared server."""
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEYS[0], max_retries=0,
                       timeout=60) as oai:
        yield oai


@pytest.fixture(scope="module")
def agent_server(tiny_model_dir: Path) -> Iterator[KvengineProcess]:
    """An engine as an agent runs it (one per test module): tool calls parsed (hermes),
    reasoning split off (qwen3), no key."""
    with KvengineProcess("--model", str(tiny_model_dir), "--served-model-name", "tiny",
                         "--max-model-len", "2048", "--num-kv-blocks", "512", "--seed", "0",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--reasoning-parser", "qwen3") as server:
        yield server


@pytest.fixture()
def oai(agent_server: KvengineProcess) -> Iterator[openai.OpenAI]:
    """A stock OpenAI client on the agent server."""
    with openai.OpenAI(base_url=agent_server.url + "/v1", api_key="none", max_retries=0,
                       timeout=120) as client:
        yield client
