"""Tokens named by id (vLLM's ``return_tokens_as_token_ids``) and the fault soak's teacher
forcing (``benchmarks.faults.answer_scoring``) against a real server: the engine's own greedy answer
scores within any margin, and an answer with foreign tokens does not."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.faults.answer_scoring import prompt_ids, score
from benchmarks.faults.chat_request import token_ids_of

MESSAGES = [{"role": "user", "content": "Count the apples in the basket, slowly."}]


def _chat(http: httpx.Client, **extra) -> dict:
    response = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0.0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 3, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_chat_and_completions_name_tokens_by_id(http: httpx.Client) -> None:
    by_text, by_id = _chat(http), _chat(http, return_tokens_as_token_ids=True)
    assert by_text["message"]["content"] == by_id["message"]["content"]
    ids = token_ids_of(by_id["logprobs"]["content"])
    assert len(ids) == 12
    assert all(t["token"].startswith("token_id:")
               for entry in by_id["logprobs"]["content"] for t in entry["top_logprobs"])
    text = http.post("/detokenize", json={"model": "tiny", "tokens": ids}).json()["prompt"]
    assert text == by_id["message"]["content"]
    completion = http.post("/v1/completions", json={
        "model": "tiny", "prompt": ids[:4], "max_tokens": 3, "logprobs": 2,
        "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]
    assert all(token.startswith("token_id:") for token in completion["tokens"])
    assert all(k.startswith("token_id:") for top in completion["top_logprobs"] for k in top)
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "a",
                                               "return_tokens_as_token_ids": "yes"}
                     ).status_code == 400


def test_teacher_forcing_tells_the_engines_answer_from_foreign_tokens(
        http: httpx.Client) -> None:
    answer = token_ids_of(_chat(http, return_tokens_as_token_ids=True)["logprobs"]["content"])
    prompt = prompt_ids(http, "", "tiny", MESSAGES)
    with ThreadPoolExecutor(4) as pool:
        own = score(http, "", "tiny", prompt, answer, top_n=20, max_margin=0.0, pool=pool)
        assert own["within"] and own["largest_margin"] < 1e-3 and own["not_in_top"] == 0
        assert own["first_nonzero"] is None and own["median_spread"] > 0
        # from position 3 on, the reference's 20th choice: a full spread from its best
        bottom = []
        for _ in range(3, len(answer)):
            top = http.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt + answer[:3] + bottom, "max_tokens": 1,
                "temperature": 0.0, "logprobs": 20, "return_tokens_as_token_ids": True}
            ).json()["choices"][0]["logprobs"]["top_logprobs"][0]
            worst = min(top, key=top.get)
            bottom.append(int(worst.removeprefix("token_id:")))
        foreign = answer[:3] + bottom
        wrong = score(http, "", "tiny", prompt, foreign, top_n=20, max_margin=0.25, pool=pool)
    assert not wrong["within"] and wrong["first_nonzero"] == 3
    assert wrong["largest_share"] > 0.25 or wrong["not_in_top"] > 0
