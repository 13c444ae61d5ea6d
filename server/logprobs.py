"""LogprobsFormatter: the engine's per-token logprobs as OpenAI's `logprobs` objects.

Completions (legacy shape): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where
`top_logprobs[i]` maps token text to logprob for the N alternatives plus the sampled token (so up
to N+1 entries, as OpenAI documents). Chat: `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`. A token's text is its own decode with
special tokens kept; a token that is only part of a UTF-8 character reads as U+FFFD (its `bytes`
are those of that text, not the raw byte piece). With ``as_ids`` (vLLM's
``return_tokens_as_token_ids``) every token is named ``token_id:{id}`` instead, so a client can
tell apart tokens that decode alike; completions' ``text_offset`` still counts the decoded text.

Prompt logprobs (vLLM's ``prompt_logprobs``, and ``echo`` with ``logprobs``): the prompt's first
token has none (nothing predicts it): its completions entry reads ``null`` (``PromptHead``), and
``prompt_logprobs`` lists ``null`` for it, then per token ``{str(id): {"logprob", "rank",
"decoded_token"}}`` with the prompt token first and the N alternatives after (ranks 1..N), as
vLLM 0.32 sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

TOKEN_ID_PREFIX = "token_id:"  # a token named by id (vLLM's return_tokens_as_token_ids)
_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM send this floor instead
_MAX_CACHED_TOKENS = 1 << 16


class TokenLogprobsView(Protocol):
    """What the engine hands back per generated token (engine.logprobs.TokenLogprobs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int


class PromptHead(NamedTuple):
    """The first token of an echoed prompt: shown, with no logprob (``null``) and no top."""

    token_id: int
    logprob: None = None
    top: tuple[tuple[int, float], ...] = ()


class LogprobsFormatter:
    """Builds the objects; token texts are decoded once and kept (a bounded cache)."""

    def __init__(self, decode: Callable[..., str], as_ids: bool = False) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}
        self.as_ids = as_ids

    def label(self, token_id: int) -> str:
        """How the token is named in the response: its text, or ``token_id:{id}``."""
        return f"{TOKEN_ID_PREFIX}{token_id}" if self.as_ids else self.token_text(token_id)

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if len(self._texts) >= _MAX_CACHED_TOKENS:
                self._texts.clear()
            text = self._decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def completion(self, entries: Sequence[TokenLogprobsView | PromptHead], text_offset: int,
                   num_top: int | None = None) -> tuple[dict[str, Any], int]:
        """The legacy object for `entries`, offsets counted from `text_offset`, at most
        `num_top` alternatives each (echoed prompt tokens may carry `prompt_logprobs`' count);
        also returns the offset after the last token (where a stream's next chunk continues)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for entry in entries:
            text, label = self.token_text(entry.token_id), self.label(entry.token_id)
            tokens.append(label)
            offsets.append(text_offset)
            text_offset += len(text)
            if entry.logprob is None:  # the prompt's first token
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_floor(entry.logprob))
            top = {self.label(i): _floor(lp) for i, lp in entry.top[:num_top]}
            top.setdefault(label, _floor(entry.logprob))
            tops.append(top)
        body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}
        return body, text_offset

    def prompt_logprobs(self, entries: Sequence[TokenLogprobsView | None]
                        ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or its dict."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            position = {str(entry.token_id): self._ranked(entry.token_id, entry.logprob,
                                                         entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top, 1):
                position[str(token_id)] = self._ranked(token_id, logprob, rank)
            out.append(position)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _floor(logprob), "rank": rank,
                "decoded_token": self.token_text(token_id)}

    def chat(self, entries: Sequence[TokenLogprobsView]) -> dict[str, Any]:
        """The chat object for `entries`."""
        content = []
        for entry in entries:
            item = self._chat_token(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._chat_token(i, lp) for i, lp in entry.top]
            content.append(item)
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.label(token_id)
        return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode())}


def _floor(logprob: float) -> float:
    return max(float(logprob), _MIN_LOGPROB)
