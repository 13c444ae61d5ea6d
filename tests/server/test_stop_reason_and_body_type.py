"""vLLM's ``stop_reason`` in completions and chat (the stop string or stop token id that ended a
choice, null for eos and length), streamed on the last chunk; a body that is not JSON gets a 415
that names its Content-Type, and a broken JSON one a 400 (issue 30 item 6). The shared server on
the tiny model."""

from __future__ import annotations

import json

import httpx


def test_stop_reason_names_the_stop_string_or_token(http: httpx.Client) -> None:
    base = {"prompt": "once upon a time", "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True}
    free = http.post("/v1/completions", json=base).json()["choices"][0]
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    text = free["text"]
    stop = text[3:6] if len(text) >= 6 else text[-2:]
    assert stop.strip(), text
    got = http.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == stop, (got, stop)

    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    stop_id = ids["tokens"][2]
    got = http.post("/v1/completions", json={**base, "stop_token_ids": [stop_id]}).json()
    assert got["choices"][0]["stop_reason"] == stop_id

    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True}).json()["choices"][0]
    assert "stop_reason" in chat and chat["stop_reason"] is None


def test_the_last_streamed_chunk_carries_the_stop_reason(http: httpx.Client) -> None:
    base = {"prompt": "once upon a time", "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True}
    text = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = text[3:6]
    with http.stream("POST", "/v1/completions", json={**base, "stop": [stop],
                                                      "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])


def test_a_body_that_is_not_json_is_415_naming_its_type(http: httpx.Client) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = http.post(path, content=body, headers={"Content-Type": "text/plain"})
        assert r.status_code == 415, (path, r.text)
        error = r.json()["error"]
        assert "application/json" in error["message"] and "text/plain" in error["message"]
    r = http.post("/v1/completions", content=body,
                  headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", content=b"{not json",
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
