"""vLLM 0.32's request extras on both endpoints (issue 38 item 4): `priority` (0 only: first come,
first served, as vLLM without --scheduling-policy priority), `request_id` (names the response;
the engine's own ids stay unique), `truncate_prompt_tokens` (the prompt's last N tokens, -1 the
context) and `add_special_tokens` (completions: on; chat: off, the template writes them)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

MESSAGES = [{"role": "user", "content": "Name three rivers and one mountain, briefly."}]


def _post(http: httpx.Client, path: str, **body) -> httpx.Response:
    return http.post(path, json={"model": "tiny", "max_tokens": 3, "temperature": 0.0, **body})


def test_priority_other_than_zero_is_refused_with_why(http: httpx.Client) -> None:
    assert _post(http, "/v1/completions", prompt="a", priority=0).status_code == 200
    for path, body in (("/v1/completions", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        response = _post(http, path, priority=5, **body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "priority" and "first come" in error["message"]
    assert _post(http, "/v1/completions", prompt="a", priority="high").status_code == 400


def test_request_id_names_the_response_and_may_repeat(http: httpx.Client) -> None:
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: _post(http, "/v1/chat/completions", messages=MESSAGES,
                                                request_id="agent-7-step-3", max_tokens=20),
                                range(2)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert [r.json()["id"] for r in replies] == ["chatcmpl-agent-7-step-3"] * 2
    assert _post(http, "/v1/completions", prompt="a",
                 request_id="x").json()["id"] == "cmpl-x"
    assert _post(http, "/v1/completions", prompt="a", request_id="").status_code == 400


def test_truncate_prompt_tokens_keeps_the_last_ones(http: httpx.Client) -> None:
    ids = list(range(5, 45))
    full = _post(http, "/v1/completions", prompt=ids).json()
    cut = _post(http, "/v1/completions", prompt=ids, truncate_prompt_tokens=8).json()
    same = _post(http, "/v1/completions", prompt=ids[-8:]).json()
    assert full["usage"]["prompt_tokens"] == 40 and cut["usage"]["prompt_tokens"] == 8
    assert cut["choices"][0]["text"] == same["choices"][0]["text"]
    whole = _post(http, "/v1/completions", prompt=ids, truncate_prompt_tokens=-1).json()
    assert whole["usage"]["prompt_tokens"] == 40
    chat = _post(http, "/v1/chat/completions", messages=MESSAGES, truncate_prompt_tokens=5)
    assert chat.json()["usage"]["prompt_tokens"] == 5
    assert _post(http, "/v1/completions", prompt="a",
                 truncate_prompt_tokens=0).status_code == 400


def test_add_special_tokens_tokenizes_as_tokenize_does(http: httpx.Client) -> None:
    for add in (True, False):
        counted = http.post("/tokenize", json={"model": "tiny", "prompt": "Rivers run.",
                                               "add_special_tokens": add}).json()["count"]
        usage = _post(http, "/v1/completions", prompt="Rivers run.",
                      add_special_tokens=add).json()["usage"]
        assert usage["prompt_tokens"] == counted
    chat = {add: _post(http, "/v1/chat/completions", messages=MESSAGES,
                       add_special_tokens=add).json()["usage"]["prompt_tokens"]
            for add in (True, False)}
    rendered = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()
    assert chat[False] == rendered["count"] and chat[True] >= chat[False]
