"""One greedy chat request of the fault soak's load and its reference, and the ids of the
answer's tokens (asked for by id, so nothing is re-tokenized)."""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from server.logprobs import TOKEN_ID_PREFIX


def ask(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]],
        max_tokens: int, token_ids: bool = False) -> dict:
    """One greedy chat completion: its body (HTTPStatusError on an error status); with
    ``token_ids`` its ``logprobs`` name the answer's tokens by id."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    if token_ids:
        body.update(logprobs=True, return_tokens_as_token_ids=True)
    response = client.post(url + "/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


def token_ids_of(logprobs_content: Sequence[dict]) -> list[int]:
    """The ids of a chat answer's tokens, from its ``logprobs.content`` (tokens as ids)."""
    ids = []
    for entry in logprobs_content:
        token = entry["token"]
        if not token.startswith(TOKEN_ID_PREFIX):
            raise ValueError(f"a logprobs token {token!r} is not named by id: ask with "
                             "return_tokens_as_token_ids")
        ids.append(int(token[len(TOKEN_ID_PREFIX):]))
    return ids
