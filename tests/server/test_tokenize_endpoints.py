"""/tokenize, /detokenize, /version, /docs and /openapi.json with vLLM's shapes, on the shared
real server through a real HTTP client."""

from __future__ import annotations

import httpx
from server_helpers import RunningServer


def test_tokenize_a_prompt_as_the_completion_endpoint_does(http: httpx.Client,
                                                           server: RunningServer) -> None:
    text = "hello world, tokenized twice"
    r = http.post("/tokenize", json={"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = server.engine.tokenizer.encode(text)
    assert body == {"count": len(expected), "max_model_len": 512, "tokens": expected}
    done = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == body["count"]
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    # The tiny model's tokenizer is byte-level: a space is "Ġ" in its vocabulary.
    assert len(strs["token_strs"]) == len(expected)
    assert "".join(strs["token_strs"]).replace("Ġ", " ") == text
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == server.engine.tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_a_chat_as_the_chat_endpoint_does(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    done = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert body["count"] == done["usage"]["prompt_tokens"] == len(body["tokens"])
    without = http.post("/tokenize", json={"messages": messages,
                                           "add_generation_prompt": False}).json()
    assert without["count"] < body["count"]


def test_tokenize_an_agent_chat_with_tools_as_the_chat_endpoint_does(http: httpx.Client) -> None:
    """An agent's conversation: tools, an assistant's tool call, its result, template variables.
    vLLM's /tokenize takes tools and chat_template_kwargs; this one refused them (with an error
    about a missing prompt) and rendered a tool call's message without its call."""
    tools = [{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    fields = {"tools": tools, "chat_template_kwargs": {"enable_thinking": False}}
    r = http.post("/tokenize", json={"messages": messages, **fields})
    assert r.status_code == 200, r.text
    done = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                   "tool_choice": "none", **fields}).json()
    assert r.json()["count"] == done["usage"]["prompt_tokens"]
    bare = http.post("/tokenize", json={"messages": messages}).json()
    assert bare["count"] < r.json()["count"]  # the tools are in the prompt
    bad = http.post("/tokenize", json={"messages": messages,
                                       "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.text


def test_detokenize_round_trip(http: httpx.Client) -> None:
    text = "a round trip of plain words"
    tokens = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    r = http.post("/detokenize", json={"model": "tiny", "tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": text}


def test_bad_tokenization_requests(http: httpx.Client, server: RunningServer) -> None:
    vocab = server.engine.vocab_size
    r = http.post("/detokenize", json={"tokens": [vocab]})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    r = http.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.post("/tokenize", json={"prompt": 3}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "x", "stray": 1}).status_code == 400
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_version_docs_and_schema(http: httpx.Client, server: RunningServer) -> None:
    """As vLLM's, but behind the API key like every route but /health (vLLM leaves them open)."""
    from kvstore.cli.args import package_version

    r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": package_version()}
    for path in ("/version", "/docs", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401, path
    schema = http.get("/openapi.json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in ("/tokenize", "/detokenize", "/version", "/v1/completions"):
        assert path in paths, path
    assert paths["/tokenize"]["post"]["security"] == [{"bearer": []}]
    docs = http.get("/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def test_a_trailing_slash_is_answered_not_redirected_to_a_forged_host(
        http: httpx.Client) -> None:
    """Starlette's 307 for ``/v1/models/`` named the client's Host header in ``Location``."""
    r = http.get("/v1/models/", headers={"Host": "evil.example"}, follow_redirects=False)
    assert r.status_code == 200 and "location" not in r.headers
    assert r.json()["data"][0]["id"]
    assert http.post("/detokenize/", json={"tokens": [5]}).status_code == 200
