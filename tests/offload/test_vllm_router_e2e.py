"""`kvengine router` in front of two real vLLM servers (CPU) sharing one daemon: each vLLM's KV
events tell the router what it holds in HBM (keyed by the router's own chain over their token
ids), the daemon's index in the connector's keys what the node holds in DRAM. A conversation's
later turns go where its KV is, and a prefix one vLLM computed is loaded from the daemon by
the other."""

from __future__ import annotations

import time

import httpx
import pytest
from daemon_helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families
from support.router import start_router, stop_router
from support.vllm_server import VllmServer
from vllm_parts import dram_blocks, running_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _text(seed: int, words: int) -> str:
    vocab = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember", "frost"]
    return " ".join(vocab[(seed * 7 + i * 5 + i * i) % len(vocab)] for i in range(words))


def metric_value(text: str, name: str, labels: dict[str, str]) -> float:
    """A sample's value in Prometheus text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return sample.value
    return 0.0


def settled(daemon, quiet_s: float = 1.0, timeout_s: float = 20.0) -> bool:
    """The daemon's DRAM stopped growing for ``quiet_s`` (the saves have landed)."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        now = dram_blocks(daemon)
        if now == last:
            return True
        last = now
        time.sleep(quiet_s)
    return False


def _dram_hits(daemon) -> int:
    with daemon.client() as c:
        return int(c.stats()["counters"]["hit_blocks_dram"])


def test_turns_follow_their_kv_and_the_other_vllm_loads_it(small_model_dir, tmp_path) -> None:
    with running_daemon(tmp_path) as daemon:
        servers = {name: VllmServer(small_model_dir, daemon.socket_path, tmp_path / f"{name}.log")
                   for name in ("a", "b")}
        router = None
        try:
            for server in servers.values():
                server.wait_ready()
            args = ["--kv-store-socket", str(daemon.socket_path), "--probe-interval", "0.2"]
            for name, server in servers.items():
                args += ["--engine", f"{name}={server.url}",
                         "--kv-events", f"{name}={server.events},{server.replay}"]
            lines: list[str] = []
            router, url = start_router(small_model_dir, args, lines)
            client = httpx.Client(base_url=url, timeout=120)
            assert wait_until(lambda: client.get("/ready").status_code == 200, 30)

            def ask(messages: list[dict]) -> httpx.Response:
                r = client.post("/v1/chat/completions", json={
                    "model": str(small_model_dir), "messages": messages, "max_tokens": 4,
                    "temperature": 0.0})
                assert r.status_code == 200, r.text
                return r

            def held_blocks(name: str) -> float:
                return metric_value(client.get("/metrics").text, "kvengine:router_kv_events",
                                    {"engine": name, "counter": "residency_blocks"}) or 0

            # Four conversations: their first turns spread, each later turn goes back.
            first: dict[int, str] = {}
            history: dict[int, list[dict]] = {}
            for conv in range(4):
                history[conv] = [{"role": "user", "content": _text(conv, 700)}]
                r = ask(history[conv])
                first[conv] = r.headers["x-kvengine-engine"]
                history[conv].append(r.json()["choices"][0]["message"])
            assert set(first.values()) == {"a", "b"}, first
            assert wait_until(lambda: all(held_blocks(n) > 0 for n in servers), 20)
            for conv in range(4):
                history[conv].append({"role": "user", "content": _text(conv + 10, 60)})
                r = ask(history[conv])
                assert r.headers["x-kvengine-engine"] == first[conv], (conv, first)
            metrics = client.get("/metrics").text
            hbm_hits = sum(metric_value(metrics, "kvengine:router_requests_total",
                                        {"reason": "hbm_hit", "engine": s.url}) or 0
                           for s in servers.values())
            assert hbm_hits >= 4

            # A prefix one vLLM computed, asked of the other: loaded from the daemon, the
            # same greedy answer.
            conv = 0
            owner = servers[first[conv]]
            other = servers["b" if first[conv] == "a" else "a"]
            body = {"model": str(small_model_dir), "messages": history[conv], "max_tokens": 4,
                    "temperature": 0.0}
            want = httpx.post(owner.url + "/v1/chat/completions", json=body, timeout=120)
            assert settled(daemon)
            before = _dram_hits(daemon)
            got = httpx.post(other.url + "/v1/chat/completions", json=body, timeout=120)
            assert got.status_code == want.status_code == 200
            assert got.json()["choices"][0]["message"]["content"] == \
                want.json()["choices"][0]["message"]["content"]
            assert _dram_hits(daemon) - before >= 5  # 700 words: several 128-token blocks
            # The router learnt the connector's keys from the daemon and asked it where each
            # prompt is (DRAM, SSD) besides what the events say of HBM.
            located = metric_value(client.get("/metrics").text,
                                   "kvengine:router_kv_locate_seconds_count", {})
            assert located >= 4, "".join(lines[-20:])
            # Each vLLM's prefill rate measured from its /metrics (its computed prompt tokens
            # over its prefill time), not the GPU priors.
            metrics = client.get("/metrics").text
            for server in servers.values():
                assert metric_value(metrics, "kvengine:router_engine_prefill_tokens_per_second",
                                    {"engine": server.url}) > 0
        finally:
            if router is not None:
                stop_router(router)
            for server in servers.values():
                server.stop()
