"""`kvengine router` in front of real engines: one `kvstore serve`, two CPU `kvengine serve
--kv-offload` on the tiny model, and the router, all real processes shared by the module.

Which engine served a request is read from the engines themselves (GET /load's finished count),
why from the router's /metrics. The engine killed with SIGKILL is the module's last test; the
daemon stopped with SIGSTOP the one before it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from daemon_helpers import RunningDaemon, start_daemon, wait_until
from server_helpers import API_KEYS, METRICS_KEY, metric_value
from support.kvengine import KvengineProcess, run_kvengine
from support.router import start_router, stop_router

from engine import LLM, SamplingParams
from server.auth import key_salt, tenant_salt
from server.router.policy import RouteReason

pytestmark = pytest.mark.timeout(180)

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
OTHER_TENANT = {"Authorization": f"Bearer {API_KEYS[1]}"}
METRICS = {"Authorization": f"Bearer {METRICS_KEY}"}
BODY_LIMIT = 64 * 1024
LOCATE_TIMEOUT_MS = 200  # not 50 (the default): a loaded 2-core CI box must not fall back


@dataclass
class Node:
    daemon: RunningDaemon
    engines: list[KvengineProcess]
    router: subprocess.Popen
    url: str  # the router's
    lines: list[str]  # the router's stderr

    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]


def _start_router(model_dir: Path, daemon: RunningDaemon, engine_urls: list[str],
                  lines: list[str]) -> tuple[subprocess.Popen, str]:
    args = ["--kv-store-socket", str(daemon.socket_path), "--probe-interval", "0.2",
            "--kv-retry-interval", "0.5", "--kv-locate-timeout-ms", str(LOCATE_TIMEOUT_MS),
            "--metrics-key", METRICS_KEY, "--max-request-body-bytes", str(BODY_LIMIT),
            "--log-level", "info", "--engine-header", "url"]
    for url in engine_urls:
        args += ["--engine", url]
    for key in API_KEYS:
        args += ["--api-key", key]
    return start_router(model_dir, args, lines)


@pytest.fixture(scope="module")
def node(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    daemon = start_daemon(tmp_path_factory.mktemp("router-daemon"), dram="64MiB", http=False)
    engine_args = [str(tiny_model_dir), "--kv-offload", "--kv-store-socket",
                   str(daemon.socket_path), "--num-kv-blocks", "256", "--max-model-len", "4096",
                   "--max-num-seqs", "2", "--max-request-body-bytes", str(BODY_LIMIT),
                   "--metrics-key", METRICS_KEY, "--no-warm-up"]
    for key in API_KEYS:
        engine_args += ["--api-key", key]
    engines: list[KvengineProcess] = []
    router = None
    lines: list[str] = []
    try:
        for _ in range(2):
            engines.append(KvengineProcess(*engine_args, env={"KVENGINE_API_KEY": None}))
        router, url = _start_router(tiny_model_dir, daemon, [e.url for e in engines], lines)
        assert wait_until(lambda: httpx.get(url + "/ready", headers=AUTH).status_code == 200,
                          30)
        yield Node(daemon, engines, router, url, lines)
    finally:
        if router is not None:
            stop_router(router)
        for engine in engines:
            engine.stop()
        daemon.stop()


# ------------------------------------------------------------------------------------ helpers


def _finished(engine_url: str) -> int:
    load = httpx.get(engine_url + "/load", headers=AUTH, timeout=10).json()
    return int(load["num_requests_finished"])


def _served_by(node: Node, send) -> tuple[str, httpx.Response]:
    """Send through the router; the engine whose finished count moved, and the response."""
    before = {url: _finished(url) for url in node.engine_urls()}
    response = send()
    assert response.status_code == 200, response.text
    moved = [url for url in node.engine_urls() if _finished(url) > before[url]]
    assert len(moved) == 1, (before, moved)
    assert response.headers["x-kvengine-engine"] == moved[0]  # the router names it
    return moved[0], response


def _metrics(node: Node) -> str:
    response = httpx.get(node.url + "/metrics", headers=METRICS, timeout=10)
    assert response.status_code == 200, response.text
    return response.text


def _routed(node: Node, reason: str, engine: str | None = None) -> float:
    text = _metrics(node)
    urls = [engine] if engine is not None else node.engine_urls()
    return sum(metric_value(text, "kvengine:router_requests_total", reason=reason, engine=url)
               for url in urls)


def _hbm_blocks(node: Node) -> int:
    with node.daemon.client() as c:
        return int(c.stats()["tiers"]["hbm"]["blocks"])


def _text(tag: str, num_words: int = 60) -> str:
    words = ["river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "thunder"]
    return f"{tag}: " + " ".join(words[(i * 7 + len(tag)) % len(words)] + str(i % 13)
                                  for i in range(num_words))


def _chat(node: Node, messages: list[dict], headers: dict = AUTH, **fields) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0.0, **fields}
    return httpx.post(node.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def _complete(url: str, prompt, headers: dict = AUTH, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, **fields}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


# -------------------------------------------------------------------------------------- tests


def test_a_second_turn_lands_where_the_first_was_served(node: Node) -> None:
    first = [{"role": "user", "content": _text("turn one")}]
    published = _hbm_blocks(node)
    engine, response = _served_by(node, lambda: _chat(node, first))
    reply = response.json()["choices"][0]["message"]["content"]
    num_blocks = response.json()["usage"]["prompt_tokens"] // 16
    # The engine publishes its blocks right after the step that computed them.
    assert wait_until(lambda: _hbm_blocks(node) >= published + num_blocks, 10)
    hits_before = _routed(node, "hbm_hit", engine)
    stages = ("route", "prompt", "kv_locate")

    def timed() -> list[float]:  # what each routing decision cost, counted once per stage
        text = _metrics(node)
        return [metric_value(text, f"kvengine:router_{stage}_seconds_count") for stage in stages]

    counts = timed()
    second = [*first, {"role": "assistant", "content": reply},
              {"role": "user", "content": "and then what happened next?"}]
    again, response = _served_by(node, lambda: _chat(node, second))
    assert again == engine
    assert _routed(node, "hbm_hit", engine) == hits_before + 1
    assert timed() == [count + 1 for count in counts]
    by_tier = response.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    assert by_tier["hbm"] >= 16 * (num_blocks - 1), by_tier


def test_an_agents_next_turn_with_tools_goes_where_its_blocks_are(node: Node) -> None:
    """The router renders a chat as the engine does, tools and tool calls included: it left
    the tools out, so its chain of an agent's prompt never matched the blocks an engine had
    computed (its own memory of where it sent a conversation hid that). The first turn goes to
    the second engine directly, outside the router; the next, through the router, follows it
    by the daemon's view of that engine's HBM."""
    tools = [{"type": "function", "function": {
        "name": "lookup", "description": _text("tool doc", 40),
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    first = [{"role": "user", "content": _text("agent turn")}]
    engine = node.engine_urls()[1]
    published = _hbm_blocks(node)
    response = _chat(_Direct(engine), first, tools=tools, tool_choice="none")
    assert response.status_code == 200, response.text
    num_blocks = response.json()["usage"]["prompt_tokens"] // 16
    assert wait_until(lambda: _hbm_blocks(node) >= published + num_blocks, 10)
    hits_before = _routed(node, "hbm_hit", engine)
    second = [*first, {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": "{\"q\": \"river\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": _text("result", 20)}]
    again, _ = _served_by(node, lambda: _chat(node, second, tools=tools, tool_choice="none"))
    assert again == engine
    assert _routed(node, "hbm_hit", engine) == hits_before + 1


@dataclass
class _Direct:
    """An engine addressed as ``_chat`` addresses the router."""

    url: str


def test_new_conversations_spread_over_the_engines(node: Node) -> None:
    served = {url: 0 for url in node.engine_urls()}
    misses = _routed(node, "miss")
    for i in range(4):
        url, _ = _served_by(node, lambda i=i: _chat(
            node, [{"role": "user", "content": _text(f"fresh conversation {i}")}]))
        served[url] += 1
    assert all(served.values()), served
    assert _routed(node, "miss") == misses + 4


def test_a_prefix_only_in_dram_goes_to_the_least_loaded_engine(node: Node,
                                                               tiny_model_dir: Path) -> None:
    prompt = [(7 * i) % 900 + 20 for i in range(16 * 6 + 5)]
    salt = tenant_salt(key_salt(API_KEYS[0]), None)  # the router's tenant for AUTH
    with node.daemon.client() as c:
        stored = c.stats()["tiers"]["dram"]["blocks"]
    # An engine outside the router's pool computes it: its blocks reach DRAM, no engine's HBM.
    outsider = LLM(str(tiny_model_dir), device="cpu", kv_offload=True, num_kv_blocks=64,
                   kv_store_socket=str(node.daemon.socket_path), kv_offload_share_hbm=False)
    try:
        outsider.generate([prompt], SamplingParams(max_tokens=1), cache_salt=salt)
        with node.daemon.client() as c:
            assert wait_until(lambda: c.stats()["tiers"]["dram"]["blocks"] >= stored + 6, 10)
    finally:
        outsider.close()
    busy, idle = node.engine_urls()
    streams: list[httpx.Response] = []
    with httpx.Client(timeout=60) as client:
        try:
            for _ in range(4):  # two running, two waiting: busy for seconds
                stream = client.send(client.build_request(
                    "POST", busy + "/v1/completions", headers=AUTH, json={
                        "prompt": [11, 12, 13], "max_tokens": 2000, "ignore_eos": True,
                        "stream": True}), stream=True)
                streams.append(stream)
            assert wait_until(lambda: metric_value(_metrics(node), "kvengine:router_engine_load",
                                                   engine=busy) >= 2, 10)
            dram_hits, served = _routed(node, "dram_hit", idle), _finished(idle)
            assert _complete(node.url, prompt).status_code == 200
            assert _finished(idle) == served + 1
            assert _routed(node, "dram_hit", idle) == dram_hits + 1
        finally:
            for stream in streams:
                stream.close()  # the engine aborts them
    assert wait_until(lambda: httpx.get(busy + "/load", headers=AUTH).json()["num_in_flight"]
                      == 0, 10)


def test_streams_errors_and_keys_pass_through_unchanged(node: Node) -> None:
    engine = node.engine_urls()[0]
    # A stream: the engine's events as they come, the same text as the engine gives directly.
    body = {"prompt": _text("stream me"), "max_tokens": 6, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", node.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    direct = _complete(engine, body["prompt"], max_tokens=6).json()["choices"][0]["text"]
    streamed = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert streamed == direct
    # Errors: the same status, body and headers as from an engine directly.
    cases = [
        ({"prompt": "x", "temperature": -1.0}, AUTH, 400),
        ({"prompt": "x", "model": "no-such-model"}, AUTH, 404),
        ({"prompt": "x" * (BODY_LIMIT + 1)}, AUTH, 413),
        ({"prompt": "x"}, {}, 401),
        ({"prompt": "x"}, {"Authorization": "Bearer wrong-key"}, 401),
    ]
    for payload, headers, status in cases:
        routed = httpx.post(node.url + "/v1/completions", json=payload, headers=headers,
                            timeout=60)
        straight = httpx.post(engine + "/v1/completions", json=payload, headers=headers,
                              timeout=60)
        assert routed.status_code == straight.status_code == status, routed.text
        assert routed.json() == straight.json()
        assert routed.headers.get("www-authenticate") == straight.headers.get("www-authenticate")
    # The other endpoints come from the engines (either: they differ only in start times).
    models = httpx.get(node.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == \
        [m["id"] for m in httpx.get(engine + "/v1/models", headers=AUTH).json()["data"]]
    assert httpx.get(node.url + "/version", headers=AUTH).json() == \
        httpx.get(engine + "/version", headers=AUTH).json()
    tokens = httpx.post(node.url + "/tokenize", json={"prompt": "hello there"}, headers=AUTH)
    assert tokens.json() == httpx.post(engine + "/tokenize", json={"prompt": "hello there"},
                                       headers=AUTH).json()
    assert httpx.get(node.url + "/health").json()["status"] == "ok"


def test_tenants_never_route_by_each_others_prefixes(node: Node) -> None:
    text = _text("a tenant's own prefix")
    published = _hbm_blocks(node)
    owner, response = _served_by(node, lambda: _complete(node.url, text))
    num_blocks = response.json()["usage"]["prompt_tokens"] // 16
    assert wait_until(lambda: _hbm_blocks(node) >= published + num_blocks, 10)
    hits, misses = _routed(node, "hbm_hit"), _routed(node, "miss")
    # Another key, and the same key with a cache_salt: other tenants, nothing of theirs held.
    for headers, fields in ((OTHER_TENANT, {}), (AUTH, {"cache_salt": "elsewhere"})):
        _, response = _served_by(node, lambda h=headers, f=fields: _complete(node.url, text, h,
                                                                             **f))
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _routed(node, "hbm_hit") == hits and _routed(node, "miss") == misses + 2
    # The owner itself is routed by it.
    url, _ = _served_by(node, lambda: _complete(node.url, text))
    assert url == owner and _routed(node, "hbm_hit") == hits + 1


def test_a_client_that_leaves_cancels_the_request_at_the_engine(node: Node) -> None:
    def aborted() -> float:
        return sum(metric_value(httpx.get(url + "/metrics", headers=METRICS).text,
                                "vllm:request_success_total", finished_reason="abort")
                   for url in node.engine_urls())

    before = aborted()
    body = {"prompt": [9, 9, 9], "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # gone while the engine is still generating
        httpx.post(node.url + "/v1/completions", headers=AUTH, json=body, timeout=0.5)
    with httpx.stream("POST", node.url + "/v1/completions", headers=AUTH, timeout=30,
                      json={**body, "stream": True}) as response:
        next(response.iter_lines())  # the first event, then gone
    assert wait_until(lambda: aborted() == before + 2, 15)


def test_a_stopped_daemon_costs_no_more_than_the_bound(node: Node) -> None:
    prompt = _text("while the daemon sleeps")
    fallbacks = _routed(node, "fallback")
    os.kill(node.daemon.proc.pid, signal.SIGSTOP)
    try:
        for i in range(3):
            response = _complete(node.url, f"{prompt} {i}")
            assert response.status_code == 200, response.text
    finally:
        os.kill(node.daemon.proc.pid, signal.SIGCONT)
    assert _routed(node, "fallback") >= fallbacks + 3
    metrics = _metrics(node)
    waits = metric_value(metrics, "kvengine:router_kv_locate_seconds_count")
    bounded = metric_value(metrics, "kvengine:router_kv_locate_seconds_bucket",
                           le=str(5 * LOCATE_TIMEOUT_MS / 1000))
    assert waits == bounded  # no request waited for the daemon past 5x its bound
    assert sum(metric_value(metrics, "kvengine:router_kv_store_state", state=state)
               for state in ("hung", "down")) == 1  # no answer, or not even a connection
    # Continued: it is asked again (after --kv-retry-interval) and answers.
    assert wait_until(lambda: _complete(node.url, prompt).status_code == 200 and metric_value(
        _metrics(node), "kvengine:router_kv_store_state", state="ok") == 1, 20)


def test_a_killed_engine_costs_no_request_after_the_one_in_flight(node: Node) -> None:
    def routed_to() -> dict[str, float]:
        metrics = _metrics(node)
        return {e.url: sum(metric_value(metrics, "kvengine:router_requests_total",
                                        reason=reason.value, engine=e.url)
                           for reason in RouteReason) for e in node.engines}

    before = routed_to()
    with httpx.Client(timeout=60) as client:
        stream = client.send(client.build_request(
            "POST", node.url + "/v1/completions", headers=AUTH, json={
                "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}),
            stream=True)
        try:
            assert stream.status_code == 200
            next(stream.iter_lines())  # under way
            after = routed_to()
            (doomed,) = [e for e in node.engines if after[e.url] > before[e.url]]
            (survivor,) = [e for e in node.engines if e is not doomed]
            doomed.proc.send_signal(signal.SIGKILL)
            doomed.proc.wait(10)
        finally:
            stream.close()  # the one in flight: it may have failed, nothing is asked of it
    served = _finished(survivor.url)
    for i in range(6):
        response = _complete(node.url, _text(f"after the kill {i}"))
        assert response.status_code == 200, response.text
    assert _finished(survivor.url) == served + 6
    ready = httpx.get(node.url + "/ready", headers=AUTH).json()
    assert ready["engines"] == {doomed.url: "down", survivor.url: "ready"}


def test_a_trailing_slash_is_answered_not_redirected(node: Node) -> None:
    r = httpx.get(node.url + "/v1/models/", headers={**AUTH, "Host": "evil.example"},
                  follow_redirects=False, timeout=10)
    assert r.status_code == 200 and "location" not in r.headers


def test_router_help_documents_every_flag() -> None:
    from server.router.args import add_router_arguments

    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    out = run_kvengine(["router", "--help"]).stdout
    missing = sorted(flag for flag in flags if flag not in out)
    assert not missing, missing
    assert "--engine [NAME=]URL" in out and "MODEL" in out
