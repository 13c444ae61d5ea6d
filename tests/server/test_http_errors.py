"""Every client error gets the OpenAI error shape and the right status; the server stays up."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import API_KEYS, MAX_MODEL_LEN, assert_healthy, start_server, stop_server

from engine import SamplingParams
from server.async_engine import EngineRequest
from server.request_checks import logprob_entries


def _assert_error(response: httpx.Response, status: int, param: str | None = None,
                  code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0.0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(129)]}, "stop"),  # MAX_STOP_STRINGS
    ({"prompt": "x", "stop": ["y" * 16_385]}, "stop"),  # MAX_STOP_CHARS
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(20_001)}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [1] * 20_001}, "stop_token_ids"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": [1, -3]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_parameters_are_400(http: httpx.Client, body: dict, param: str) -> None:
    error = _assert_error(http.post("/v1/completions", json=body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [
    {"messages": "hello"},
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -2},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
])
def test_bad_chat_parameters_are_400(http: httpx.Client, body: dict) -> None:
    _assert_error(http.post("/v1/chat/completions", json=body), 400)


def test_malformed_json_is_400(http: httpx.Client, server) -> None:
    response = http.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                         headers={"content-type": "application/json"})
    _assert_error(response, 400)
    response = http.post("/v1/chat/completions", content=b"[1, 2, 3]",
                         headers={"content-type": "application/json"})
    _assert_error(response, 400)
    assert_healthy(server.url)


def test_too_long_prompt_is_400(http: httpx.Client, server) -> None:
    ids = [5] * (MAX_MODEL_LEN + 10)
    _assert_error(http.post("/v1/completions", json={"prompt": ids}), 400, param="prompt",
                  code="context_length_exceeded")
    text = "cache " * (MAX_MODEL_LEN * 2)
    _assert_error(http.post("/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": text}]}),
                  400, param="messages", code="context_length_exceeded")
    # Prompt fits but prompt + max_tokens does not.
    _assert_error(http.post("/v1/completions",
                            json={"prompt": [5] * (MAX_MODEL_LEN - 4), "max_tokens": 10}),
                  400, param="max_tokens", code="context_length_exceeded")
    assert_healthy(server.url)


def test_out_of_vocabulary_token_id_is_400(http: httpx.Client, server) -> None:
    _assert_error(http.post("/v1/completions", json={"prompt": [1, 10**9]}), 400,
                  param="prompt")
    assert_healthy(server.url)


def test_a_top_k_past_int32_is_served_and_the_engine_stays_up(http: httpx.Client,
                                                               server) -> None:
    """It overflowed the step's int32 array, which failed every request and stopped the
    engine; now it samples as top_k off, as vLLM's does."""
    for top_k in (2**31, 2**63):
        body = {"prompt": "x", "max_tokens": 2, "temperature": 1.0, "top_k": top_k}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    assert_healthy(server.url)
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_unknown_model_is_404(http: httpx.Client, server) -> None:
    _assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404,
                  param="model", code="model_not_found")
    _assert_error(http.post("/v1/chat/completions", json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404,
        code="model_not_found")
    assert_healthy(server.url)


def test_unknown_route_is_404_in_openai_shape(http: httpx.Client) -> None:
    _assert_error(http.get("/v1/engines"), 404)
    _assert_error(http.get("/v1/completions"), 405)


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": f"Basic {API_KEYS[0]}"},
    {"Authorization": f"Bearer {API_KEYS[0]}x"},
])
def test_wrong_or_missing_key_is_401(server, headers: dict) -> None:
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
        for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/nowhere")]:
            response = c.request(method, path, json={"prompt": "x"})
            _assert_error(response, 401, code="invalid_api_key")
        assert c.get("/health").status_code == 200  # health stays open for probes
    assert_healthy(server.url)


def test_every_configured_key_is_accepted(server) -> None:
    for key in API_KEYS:
        assert_healthy(server.url, api_key=key)


def test_openai_client_sees_typed_errors(client) -> None:
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=9.0)
    assert info.value.body["param"] == "temperature"


def test_a_batch_larger_than_the_engine_ever_admits_is_400_not_retry_later(
        http: httpx.Client, server) -> None:
    """10,000 prompts can never be in flight at once: retrying would fail for good, so the
    answer is a 400 that says so, not the 503 "overloaded; retry later" of a full queue."""
    error = _assert_error(http.post("/v1/completions", json={
        "prompt": [[1, 2]] * 10_000, "max_tokens": 1}), 400)
    assert "10000 sequences" in error["message"] and "at most" in error["message"]
    assert_healthy(server.url)


def test_a_request_of_too_many_logprob_entries_is_400(tiny_model_dir) -> None:
    """n=64 copies of a 1,000-token prompt's prompt_logprobs with 20 alternatives would be 1.3M
    entries (one such response held 4 GB of the server's memory): refused before it runs."""
    server = start_server(tiny_model_dir, max_model_len=2048, max_num_seqs=64)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            error = _assert_error(http.post("/v1/completions", json={
                "prompt": [5] * 1000, "max_tokens": 1, "n": 64, "prompt_logprobs": 20}), 400,
                param="prompt_logprobs")
            assert "1344000 logprob entries" in error["message"], error["message"]
            small = http.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 2,
                                                       "echo": True, "logprobs": 5})
            assert small.status_code == 200, small.text[:300]
            generated = _assert_error(http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "n": 64,
                "logprobs": True, "top_logprobs": 20}), 400, param="top_logprobs")
            assert "1344000 logprob entries" in generated["message"]
    finally:
        stop_server(server)


def test_generated_logprobs_count_only_up_to_a_max_tokens_the_client_set() -> None:
    """Without max_tokens a request may run to the end of the context: counting that would
    refuse a plain ``logprobs`` request on any long-context model."""
    params = SamplingParams(max_tokens=100_000, logprobs=20, prompt_logprobs=1)
    requests = [EngineRequest("r", [1, 2, 3], params)]
    assert logprob_entries(requests) == (6, 2_100_000)
    assert logprob_entries(requests, count_generated=False) == (6, 0)
