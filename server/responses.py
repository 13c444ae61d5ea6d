"""Builders of the OpenAI response bodies and stream chunks (plain dicts, serialized once)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore import Tier
from server.logprobs import PromptHead

TIERS = tuple(t.value for t in Tier)


@dataclass
class ChoiceState:
    """What the server has seen of one engine request: one choice of the response."""

    index: int
    prompt_index: int
    num_prompt_tokens: int
    text: str = ""
    num_sent_chars: int = 0  # streamed text so far, in characters of `text`
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    message: dict[str, Any] | None = None  # chat: the parsed message (tool calls, reasoning)
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    first_token_time: float | None = None
    last_token_time: float | None = None
    role_sent: bool = False
    logprobs: list[Any] | None = None  # engine entries so far, when the request asked for them
    num_sent_logprobs: int = 0  # entries already streamed
    logprobs_text_offset: int = 0  # completions: text_offset where the next streamed token starts
    logprobs_body: dict[str, Any] | None = None  # the response's `logprobs`, built at the end
    # Echo (completions): the prompt's text goes in front of the generated text and, with
    # logprobs, its tokens in front of theirs; `echo_only` (max_tokens 0) hides what was generated.
    echo_text: str | None = None
    echo_only: bool = False
    echo_sent: bool = False  # streamed: the first chunk carried the prompt
    prompt_token_ids: list[int] | None = None  # when echoed (the first token's entry)
    prompt_logprobs: list[Any] | None = None  # engine entries, None first, when computed
    prompt_logprobs_body: list[Any] | None = None  # vLLM's `prompt_logprobs`, built at the end

    def echo_entries(self) -> list[Any]:
        """The echoed prompt's logprob entries: its first token unscored, then the others'."""
        if not self.prompt_token_ids or not self.prompt_logprobs:
            return []
        return [PromptHead(self.prompt_token_ids[0]), *self.prompt_logprobs[1:]]

    def take_logprobs(self) -> list[Any]:
        """Entries not streamed yet (they go out with the next chunk of this choice)."""
        if not self.logprobs:
            return []
        entries = self.logprobs[self.num_sent_logprobs:]
        self.num_sent_logprobs = len(self.logprobs)
        return entries

    def take_delta(self, final: bool) -> str:
        """Text not streamed yet. An unfinished tail that is an incomplete UTF-8 character
        (decoded as U+FFFD) is held back until the next token completes it."""
        end = len(self.text)
        if not final:
            while end > self.num_sent_chars and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.num_sent_chars:
            return ""
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta


def usage(choices: Sequence[ChoiceState]) -> dict[str, Any]:
    """`usage` with prompt tokens counted once per prompt (not per sample) and cached tokens
    taken from each prompt's first sample, as the OpenAI API counts them."""
    first_of_prompt: dict[int, ChoiceState] = {}
    for choice in sorted(choices, key=lambda c: c.index):
        first_of_prompt.setdefault(choice.prompt_index, choice)
    num_prompt = sum(c.num_prompt_tokens for c in first_of_prompt.values())
    num_completion = sum(c.num_tokens for c in choices)
    by_tier = {tier: 0 for tier in TIERS}
    for c in first_of_prompt.values():
        for tier in TIERS:
            by_tier[tier] += int(c.cached_tokens_by_tier.get(tier, 0))
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(c.num_cached_tokens for c in first_of_prompt.values()),
            "cached_tokens_by_tier": by_tier,
        },
    }


def completion_body(response_id: str, created: int, model: str,
                    choices: Sequence[ChoiceState]) -> dict[str, Any]:
    """A `text_completion` response."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [_completion_choice(c) for c in sorted(choices, key=lambda c: c.index)],
        "usage": usage(choices),
    }


def _completion_choice(c: ChoiceState) -> dict[str, Any]:
    choice = {"index": c.index, "text": c.text, "logprobs": c.logprobs_body,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if c.prompt_logprobs_body is not None:  # vLLM's place: the choice
        choice["prompt_logprobs"] = c.prompt_logprobs_body
    return choice


def chat_body(response_id: str, created: int, model: str,
              choices: Sequence[ChoiceState]) -> dict[str, Any]:
    """A `chat.completion` response; vLLM's `prompt_logprobs` (one prompt) beside `usage`."""
    body = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": c.index,
                "message": c.message or {"role": "assistant", "content": c.text},
                "logprobs": c.logprobs_body,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in sorted(choices, key=lambda c: c.index)
        ],
        "usage": usage(choices),
    }
    prompt_logprobs = next((c.prompt_logprobs_body for c in sorted(choices, key=lambda c: c.index)
                            if c.prompt_logprobs_body is not None), None)
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def completion_chunk(response_id: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None, with_usage_field: bool,
                     logprobs: dict[str, Any] | None = None,
                     stop_reason: int | str | None = None) -> dict[str, Any]:
    """One streamed `text_completion` chunk for one choice."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
             "stop_reason": stop_reason}
        ],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_chunk(response_id: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None, with_usage_field: bool,
               logprobs: dict[str, Any] | None = None,
               stop_reason: int | str | None = None) -> dict[str, Any]:
    """One streamed `chat.completion.chunk` for one choice."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
             "stop_reason": stop_reason}
        ],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(response_id: str, created: int, model: str, object_name: str,
                choices: Sequence[ChoiceState]) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, usage set."""
    return {"id": response_id, "object": object_name, "created": created, "model": model,
            "choices": [], "usage": usage(choices)}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
