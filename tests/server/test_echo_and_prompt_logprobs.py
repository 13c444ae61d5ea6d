"""vLLM 0.32's `echo` and `prompt_logprobs` through a real server (issue 38 item 4).

lm-eval-harness scores a text with `echo: true, logprobs: N, max_tokens: 0 or 1`: the choice's
text starts with the prompt and `logprobs` covers the prompt's tokens (the first one `null`) then
the generated ones. The reference for every prompt token's logprob is the offline engine on the
same model generating that very token greedily after the tokens before it (a logit bias makes it
the argmax; logprobs are taken from the raw logits, before the bias). `prompt_logprobs` has
vLLM's shape (a list per prompt token: null, then {id: {logprob, rank, decoded_token}}) where
vLLM puts it: on the completion choice, at the top of a chat response.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams

PROMPT = "The tiered cache keeps blocks of keys and values for the turns"
MESSAGES = [{"role": "user", "content": "Name a river."}]
# Longer than two 16-token blocks: a prefix-cache hit is possible for it.
LONG_PROMPT = ("Agents come back to warm prefixes again and again, so the store keeps every "
               "block a session computed and serves it to the next turn of the session")


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path):
    with LLM(str(tiny_model_dir), device="cpu") as llm:
        yield llm


def _forced_logprobs(llm: LLM, token_ids: list[int], num_top: int) -> list:
    """Per token after the first: the engine's entry when it generates that token greedily
    after the ones before it."""
    prefixes = [token_ids[:i] for i in range(1, len(token_ids))]
    params = [SamplingParams(max_tokens=1, logprobs=num_top, logit_bias={token_ids[i]: 100.0})
              for i in range(1, len(token_ids))]
    outs = llm.generate(prefixes, params)
    assert [o.token_ids[0] for o in outs] == token_ids[1:]
    return [o.logprobs[0] for o in outs]


def _complete(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={"model": "tiny", "temperature": 0.0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _check_prompt_part(logprobs: dict, token_ids: list[int], want: list, num_top: int,
                       decode) -> None:
    """The first len(token_ids) entries of a completions `logprobs` score the prompt."""
    n = len(token_ids)
    assert logprobs["tokens"][:n] == [decode([t], skip_special_tokens=False) for t in token_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:n] == pytest.approx([e.logprob for e in want], abs=1e-5)
    for top, entry in zip(logprobs["top_logprobs"][1:n], want, strict=True):
        expected = {decode([i], skip_special_tokens=False): lp for i, lp in entry.top}
        expected.setdefault(decode([entry.token_id], skip_special_tokens=False), entry.logprob)
        assert top == pytest.approx(expected, abs=1e-5)
        assert len(top) <= num_top + 1
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert offsets[0] == 0
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [len(t) for t in tokens[:-1]]


def test_echo_scores_the_prompt_as_the_engine_generates_it(http: httpx.Client, offline: LLM
                                                           ) -> None:
    ids = offline.tokenizer.encode(PROMPT)
    want = _forced_logprobs(offline, ids, 3)
    greedy = offline.generate([ids], SamplingParams(max_tokens=2, logprobs=3))[0]
    body = _complete(http, prompt=PROMPT, echo=True, logprobs=3, max_tokens=2)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT + greedy.text
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 2
    _check_prompt_part(logprobs, ids, want, 3, offline.tokenizer.decode)
    assert logprobs["token_logprobs"][len(ids):] == pytest.approx(
        [e.logprob for e in greedy.logprobs], abs=1e-5)
    # vLLM fills prompt_logprobs from echo's logprobs too: the same numbers, by token id
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position, token_id, entry in zip(prompt_logprobs[1:], ids[1:], want, strict=True):
        assert next(iter(position)) == str(token_id)  # the prompt token first, as vLLM
        assert position[str(token_id)]["logprob"] == pytest.approx(entry.logprob, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 2
    # the same through a token-id prompt: its text is the tokens decoded
    by_ids = _complete(http, prompt=ids, echo=True, logprobs=3, max_tokens=2)["choices"][0]
    assert by_ids["text"] == offline.tokenizer.decode(ids, skip_special_tokens=False) + \
        greedy.text
    assert by_ids["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"],
                                                                 abs=1e-5)


def test_echo_with_max_tokens_0_is_the_prompt_alone(http: httpx.Client, offline: LLM) -> None:
    texts = [PROMPT, "Rivers run to the sea"]
    body = _complete(http, prompt=texts, echo=True, logprobs=1, max_tokens=0)
    for choice, text in zip(body["choices"], texts, strict=True):
        ids = offline.tokenizer.encode(text)
        assert choice["text"] == text
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids)
        _check_prompt_part(logprobs, ids, _forced_logprobs(offline, ids, 1), 1,
                           offline.tokenizer.decode)
    # as vLLM: one token is generated (and counted) but not shown
    assert body["usage"]["completion_tokens"] == 2
    events = _events(http.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0,
        "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == body["choices"][0]["logprobs"]["tokens"]
    # without echo, max_tokens 0 asks for nothing: refused as vLLM does
    refused = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_echo_without_logprobs_and_streamed_echo(http: httpx.Client) -> None:
    plain = _complete(http, prompt=PROMPT, max_tokens=4)["choices"][0]
    echoed = _complete(http, prompt=PROMPT, echo=True, max_tokens=4)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    assert echoed["logprobs"] is None and "prompt_logprobs" not in echoed
    whole = _complete(http, prompt=PROMPT, echo=True, logprobs=2, max_tokens=5)["choices"][0]
    events = _events(http.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 5,
        "temperature": 0.0, "stream": True}))
    first = events[0]["choices"][0]
    assert first["text"].startswith(PROMPT)  # vLLM: the prompt comes in the first chunk
    assert first["logprobs"]["token_logprobs"][0] is None
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    streamed: dict[str, list] = {key: [] for key in whole["logprobs"]}
    for event in events:
        for key, values in event["choices"][0]["logprobs"].items():
            streamed[key].extend(values)
    assert streamed == whole["logprobs"]


def test_prompt_logprobs_on_completions_and_chat(http: httpx.Client, offline: LLM) -> None:
    decode = offline.tokenizer.decode
    ids = offline.tokenizer.encode(PROMPT)
    want = _forced_logprobs(offline, ids, 2)
    choice = _complete(http, prompt=PROMPT, prompt_logprobs=2, max_tokens=2)["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position, token_id, entry in zip(prompt_logprobs[1:], ids[1:], want, strict=True):
        # the prompt token first with its rank in the vocabulary, then the top ones (vLLM's
        # dict: a prompt token among them keeps its place and takes its top rank)
        expected = {str(token_id): (entry.logprob, entry.rank,
                                    decode([token_id], skip_special_tokens=False))}
        for rank, (i, lp) in enumerate(entry.top, 1):
            expected[str(i)] = (lp, rank, decode([i], skip_special_tokens=False))
        assert list(position) == list(expected)
        for key, (logprob, rank, text) in expected.items():
            assert position[key] == {"logprob": pytest.approx(logprob, abs=1e-5), "rank": rank,
                                     "decoded_token": text}
    zero = _complete(http, prompt=PROMPT, prompt_logprobs=0, max_tokens=1)["choices"][0]
    assert [list(p) if p else None for p in zero["prompt_logprobs"]] == \
        [None] + [[str(t)] for t in ids[1:]]
    chat = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 1})
    assert chat.status_code == 200, chat.text
    chat_body = chat.json()
    chat_prompt = chat_body["prompt_logprobs"]  # vLLM: beside usage, not in the choice
    assert "prompt_logprobs" not in chat_body["choices"][0]
    assert len(chat_prompt) == chat_body["usage"]["prompt_tokens"] and chat_prompt[0] is None
    assert all(1 <= len(p) <= 2 for p in chat_prompt[1:])
    # a stream has no field for them: only 0 is taken there (as vLLM)
    assert http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0,
        "stream": True}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields, message", [
    ({"prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is greater than max "
                              "allowed: 20"),
    ({"prompt_logprobs": -1}, "which is greater than max allowed: 20"),
    ({"prompt_logprobs": -2}, "must be a positive value or -1"),
    ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
    ({"prompt_logprobs": "3"}, None),
])
def test_prompt_logprobs_past_the_bound_are_400(http: httpx.Client, path: str, fields: dict,
                                                message: str | None) -> None:
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    response = http.post(path, json={**body, "max_tokens": 1, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").split(".")[0] == "prompt_logprobs"
    if message is not None:
        assert message in error["message"]


def test_a_prefix_cached_prompt_still_gets_its_prompt_logprobs(http: httpx.Client,
                                                               offline: LLM) -> None:
    ids = offline.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 32
    first = _complete(http, prompt=LONG_PROMPT, max_tokens=1, cache_salt="echo-cache")
    cached = _complete(http, prompt=LONG_PROMPT, max_tokens=1, cache_salt="echo-cache")
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert first["choices"][0]["text"] == cached["choices"][0]["text"]
    scored = _complete(http, prompt=LONG_PROMPT, echo=True, logprobs=2, max_tokens=0,
                       cache_salt="echo-cache")
    # the positions it scores were computed again, not read from the cache
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _check_prompt_part(scored["choices"][0]["logprobs"], ids, _forced_logprobs(offline, ids, 2),
                       2, offline.tokenizer.decode)
    again = _complete(http, prompt=LONG_PROMPT, max_tokens=1, cache_salt="echo-cache")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # still cached


def test_shapes_validate_with_vllms_response_models(http: httpx.Client) -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponse,
        CompletionResponseChoice,
        CompletionStreamResponse,
    )
    from vllm.logprobs import Logprob

    body = _complete(http, prompt=[PROMPT, "Rivers"], echo=True, logprobs=2, max_tokens=1,
                     prompt_logprobs=3)
    parsed = CompletionResponse.model_validate(body)
    for choice, raw in zip(parsed.choices, body["choices"], strict=True):
        assert set(raw) <= set(CompletionResponseChoice.model_fields)
        assert choice.prompt_logprobs[0] is None
        for position, raw_position in zip(choice.prompt_logprobs[1:], raw["prompt_logprobs"][1:],
                                          strict=True):
            assert all(isinstance(k, int) and isinstance(v, Logprob)
                       for k, v in position.items())
            assert {str(k): {"logprob": v.logprob, "rank": v.rank,
                             "decoded_token": v.decoded_token}
                    for k, v in position.items()} == raw_position
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.top_logprobs[0] is None
        dumped = choice.logprobs.model_dump()
        assert dumped == raw["logprobs"]
    events = _events(http.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3,
        "stream": True}))
    for event in events:
        CompletionStreamResponse.model_validate(event)
    chat = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 2}).json()
    parsed_chat = ChatCompletionResponse.model_validate(chat)
    assert parsed_chat.prompt_logprobs[0] is None
    assert len(parsed_chat.prompt_logprobs) == chat["usage"]["prompt_tokens"]
