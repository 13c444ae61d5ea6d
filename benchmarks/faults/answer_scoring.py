"""Teacher forcing: does an answer that differs from the reference differ by numerics only?

Greedy decoding on a random-weight model meets near-ties: two tokens whose logits differ by less
than bf16 rounding, where a different batch (another GEMM tiling, a restored prefix computed in
another step) picks the other one, and from there the texts part. Wrong KV looks different: the
tokens after it are ones the reference would not have chosen at all.

So the reference scores the answer under test token by token on the answer's own prefix
(``/v1/completions`` with the prompt's token ids plus the answer's first ``i`` tokens, one
token, ``logprobs`` = ``top_n``). At each position the **margin** is the reference's best
logprob minus the logprob of the token the stack chose (0 where they agree; ``None`` where the
token is not even among the reference's ``top_n``), and the **spread** is the best minus the
``top_n``-th logprob. A random model's logits are flat (its top 20 may lie within half a nat),
so the margin is judged against the spread: an answer is explained by numerics when at every
position margin <= ``max_margin`` x spread. A wrong token is in the reference's top ``top_n``
of a 150k vocabulary with a chance of ``top_n`` / 150k, and then within a quarter of the
spread with about a quarter of that; a near-tie tipped by rounding is a small fraction of it.

How large a margin numerics can need is measured, not assumed (``ask_again``, then
``self_variance``): the reference answers a sample of the requests a second time, one at a time
instead of in its first pass's batches, and where its two answers part, its second answer is
scored the same way. The largest share such a
self-difference needs is this engine's own numerics on this device; the verdict's margin is the
stated one or that, whichever is larger, and the result says which.

Scoring asks one position per request, so an answer of 100 tokens after a 19k-token prompt is
100 requests over that prompt: the scorer is a reference engine with its prefix cache on, which
computes the prompt once and each position's few new tokens after it (without it, each position
of a 10-minute GPU soak was a full prefill, thousands in all, and scoring outran the device time).
The answers themselves still come from the reference without a prefix cache.

The prompt's ids come from the reference's ``/tokenize`` (the same chat template), checked
against the prompt token count the stack reported; the answer's ids from the stack's own
``logprobs`` (``return_tokens_as_token_ids``), so nothing is re-tokenized.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.faults.chat_request import ask, token_ids_of
from server.logprobs import TOKEN_ID_PREFIX


def prompt_ids(client: httpx.Client, url: str, model: str, messages: list[dict]) -> list[int]:
    """The chat prompt's token ids as the engine at ``url`` renders them."""
    response = client.post(url + "/tokenize", json={"model": model, "messages": messages,
                                                     "add_generation_prompt": True})
    response.raise_for_status()
    return response.json()["tokens"]


def position_margin(client: httpx.Client, url: str, model: str, context: list[int], token: int,
                    top_n: int) -> tuple[float | None, float]:
    """(margin of ``token`` after ``context``, spread of the reference's top ``top_n``)."""
    response = client.post(url + "/v1/completions", json={
        "model": model, "prompt": context, "max_tokens": 1, "temperature": 0.0,
        "ignore_eos": True, "logprobs": top_n, "return_tokens_as_token_ids": True})
    response.raise_for_status()
    top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    best = max(top.values())
    chosen = top.get(f"{TOKEN_ID_PREFIX}{token}")
    return (None if chosen is None else best - chosen), best - min(top.values())


def score(client: httpx.Client, url: str, model: str, prompt: list[int], answer: list[int],
          top_n: int, max_margin: float, pool: ThreadPoolExecutor) -> dict:
    """Every position of ``answer`` scored: the largest margin (nats, and as a share of its
    position's spread), the median spread, and ``within`` (every margin known and at most
    ``max_margin`` x its spread)."""
    results = list(pool.map(lambda i: position_margin(client, url, model, prompt + answer[:i],
                                                      answer[i], top_n), range(len(answer))))
    margins = [m for m, _ in results]
    shares = [m / s if s > 0 else (0.0 if m == 0 else float("inf"))
              for m, s in results if m is not None]
    return {"positions": len(answer), "not_in_top": sum(m is None for m in margins),
            "largest_margin": max((m for m in margins if m is not None), default=0.0),
            "largest_share": max(shares, default=0.0),
            "first_nonzero": next((i for i, m in enumerate(margins) if m is None or m > 0), None),
            "median_spread": statistics.median([s for _, s in results]) if results else None,
            "within": len(shares) == len(margins) and all(x <= max_margin for x in shares),
            "margins": [None if m is None else round(m, 4) for m in margins]}


def score_differences(records: list, url: str, model: str, top_n: int, max_margin: float,
                      concurrency: int, timeout_s: float, deadline: float = float("inf")) -> None:
    """Set ``numerics`` of every record whose answer differs from its reference: its score,
    or ``{"error": ...}`` where it could not be scored (which the verdict counts against it),
    also once ``deadline`` (``time.monotonic()``) has passed."""
    differing = [r for r in records if r.error is None and r.reference is not None
                 and r.answer != r.reference]
    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
        for record in differing:
            if time.monotonic() >= deadline:
                record.numerics = {"error": "not scored: the scoring time ran out",
                                   "within": False}
                continue
            try:
                if not record.answer_token_ids:
                    raise ValueError("the stack's answer came without its token ids")
                prompt = prompt_ids(client, url, model, record.messages)
                if record.prompt_tokens is not None and len(prompt) != record.prompt_tokens:
                    raise ValueError(f"the reference renders {len(prompt)} prompt tokens, the "
                                     f"stack reported {record.prompt_tokens}")
                record.numerics = score(client, url, model, prompt, record.answer_token_ids,
                                        top_n, max_margin, pool)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                record.numerics = {"error": f"{type(exc).__name__}: {exc}"[:300],
                                   "within": False}


def ask_again(records: list, url: str, model: str, max_tokens: int, sample: int,
              timeout_s: float, deadline: float = float("inf")) -> dict:
    """The reference against itself, first half: up to ``sample`` of the records it answered
    (``reference``), evenly spread, asked again one at a time (another batch composition than
    its first, concurrent pass) until ``deadline``. Returns how many were asked and failed, and
    ``differing``: (record, the second answer's token ids) wherever the two answers part."""
    todo = [r for r in records if r.error is None and r.reference is not None]
    if len(todo) > sample:
        todo = [todo[i * len(todo) // sample] for i in range(sample)]
    differing: list[tuple] = []
    errors = asked = 0
    with httpx.Client(timeout=timeout_s) as client:
        for record in todo:
            if time.monotonic() >= deadline:
                break
            asked += 1
            try:
                body = ask(client, url, model, record.messages, max_tokens, token_ids=True)
                choice = body["choices"][0]
                if choice["message"]["content"] != record.reference:
                    differing.append((record, token_ids_of(choice["logprobs"]["content"])))
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                errors += 1
    return {"asked": asked, "errors": errors, "differing": differing}


def self_variance(again: dict, url: str, model: str, top_n: int, concurrency: int,
                  timeout_s: float, deadline: float = float("inf")) -> dict:
    """The second half: each second answer that differs from the first (``ask_again``) scored
    like the stack's, until ``deadline`` (``time.monotonic()``; the rest counted unscored).
    Returns how many were asked, differed, failed and went unscored, and the largest share a
    self-difference needed (0.0 without any)."""
    scores: list[dict] = []
    errors = again["errors"]
    unscored = 0
    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
        for record, answer in again["differing"]:
            if time.monotonic() >= deadline:
                unscored += 1
                continue
            try:
                prompt = prompt_ids(client, url, model, record.messages)
                scores.append(score(client, url, model, prompt, answer, top_n, float("inf"),
                                    pool))
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                errors += 1
    return {"asked": again["asked"], "differences": len(again["differing"]), "errors": errors,
            "unscored": unscored, "not_in_top": sum(s["not_in_top"] for s in scores),
            "largest_share": max((s["largest_share"] for s in scores), default=0.0),
            "shares": sorted(round(s["largest_share"], 4) for s in scores)}
