"""A full queue answers 503; a client that goes away aborts its request and frees its blocks."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from daemon_helpers import wait_until
from server_helpers import RunningServer, assert_healthy, metric_value, start_server, stop_server

CHAT = [{"role": "user", "content": "Tell me a long story about tiered caches."}]


@pytest.fixture(scope="module")
def small(tiny_model_dir) -> Iterator[RunningServer]:
    """One running sequence and one waiting slot: the third engine request is refused."""
    running = start_server(tiny_model_dir, max_num_seqs=1, max_queue=1, max_model_len=1024)
    yield running
    stop_server(running)


def _long_chat(max_tokens: int = 900) -> dict:
    return {"messages": CHAT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def _engine_idle(server: RunningServer) -> bool:
    stats = server.async_engine.stats()
    return (server.async_engine.num_in_flight == 0 and stats.get("num_running") == 0
            and stats.get("num_waiting") == 0)


def test_full_queue_answers_503_and_recovers(small: RunningServer) -> None:
    with httpx.Client(base_url=small.url, timeout=60) as c, contextlib.ExitStack() as stack:
        streams = []
        for n in range(1, 3):  # one runs, one waits: the queue is now full
            response = stack.enter_context(c.stream("POST", "/v1/chat/completions",
                                                    json=_long_chat()))
            assert response.status_code == 200  # the headers come at once
            assert wait_until(lambda n=n: small.async_engine.num_in_flight == n, timeout_s=10)
            streams.append(response.iter_lines())
        first = next(line for line in streams[0] if line)  # the role, with the first token
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
        refused = c.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "overloaded"
        refused_n = c.post("/v1/chat/completions", json={**_long_chat(), "stream": False})
        assert refused_n.status_code == 503
        assert c.get("/health").status_code == 200
        assert metric_value(_metrics(small.url), "vllm:admission_rejections_total",
                            reason="overloaded") >= 2
    # Both streams were closed unfinished: their slots come back and requests run again.
    assert wait_until(lambda: _engine_idle(small), timeout_s=20)
    assert_healthy(small.url, api_key=None)


def test_stream_disconnect_aborts_and_frees_blocks(small: RunningServer) -> None:
    assert wait_until(lambda: _engine_idle(small), timeout_s=20)
    before = _metrics(small.url)
    aborted_before = metric_value(before, "vllm:request_success_total",
                                  finished_reason="abort")
    stats_before = small.async_engine.stats()
    with httpx.Client(base_url=small.url, timeout=60) as c, \
            c.stream("POST", "/v1/chat/completions", json=_long_chat()) as response:
        num_content = 0
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                num_content += 1
                if num_content == 3:
                    break  # leave mid-generation: closing the response drops the connection
        assert num_content == 3
        assert small.async_engine.stats()["num_running"] <= 1

    def aborted() -> bool:
        text = _metrics(small.url)
        return metric_value(text, "vllm:request_success_total",
                            finished_reason="abort") == aborted_before + 1
    assert wait_until(aborted, timeout_s=20)
    assert wait_until(lambda: _engine_idle(small), timeout_s=20)
    stats = small.async_engine.stats()
    assert stats["num_blocks_in_use"] == stats_before["num_blocks_in_use"]
    # The engine stopped generating: far fewer tokens than the 900 the request asked for.
    generated = stats["generation_tokens_total"] - stats_before["generation_tokens_total"]
    assert 3 <= generated < 900
    assert_healthy(small.url, api_key=None)


@pytest.mark.parametrize("stream", [False, True])
def test_waiting_request_is_aborted_on_disconnect(small: RunningServer, stream: bool) -> None:
    assert wait_until(lambda: _engine_idle(small), timeout_s=20)
    aborted_before = metric_value(_metrics(small.url), "vllm:request_success_total",
                                  finished_reason="abort")
    with httpx.Client(base_url=small.url, timeout=60) as c, \
            c.stream("POST", "/v1/chat/completions", json=_long_chat()) as running:
        lines = running.iter_lines()  # keep it: dropping the iterator drops the connection
        next(line for line in lines if line)
        assert wait_until(lambda: small.async_engine.stats()["num_running"] == 1, timeout_s=20)
        prompt_tokens = small.async_engine.stats()["prompt_tokens_total"]
        body = json.dumps({"prompt": "queued behind the long one", "max_tokens": 50,
                           "stream": stream}).encode()
        raw = socket.create_connection(("127.0.0.1", small.port))
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                    b"application/json\r\ncontent-length: " + str(len(body)).encode() +
                    b"\r\n\r\n" + body)
        assert wait_until(lambda: small.async_engine.num_in_flight == 2, timeout_s=20)
        raw.close()  # gone while still waiting for the running request to finish
        assert wait_until(lambda: small.async_engine.num_in_flight == 1, timeout_s=20)
        assert metric_value(_metrics(small.url), "vllm:request_success_total",
                            finished_reason="abort") == aborted_before + 1
    assert wait_until(lambda: _engine_idle(small), timeout_s=20)
    # The engine never scheduled the request that left while waiting.
    assert small.async_engine.stats()["prompt_tokens_total"] == prompt_tokens
    assert_healthy(small.url, api_key=None)
