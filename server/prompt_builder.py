"""PromptBuilder: the prompt of a request as token ids, prepared off the event loop.

Order of work for a text prompt: a length check on characters first (a text that cannot fit in
the context is refused before any tokenizing), then the chat template and the tokenizer, with the
tenant's own tokenizer cache. Small work stays on the event loop (a thread hop costs more than
it does, and the warm turn of a long chat is mostly cached segments); large work goes to a worker
thread of a bounded pool, so no request stops the loop for more than a few milliseconds.

A list of prompts is one request: each prompt is checked as one, the request's total against
`max_request_tokens` (both on characters, before tokenizing), then the whole list is tokenized
as one job of the pool unless it is small, so a batch of many short prompts (each small enough
to encode inline) cannot add up to seconds on the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.api_error import APIError
from server.engine_protocol import PromptCodec
from server.prompt_tokenizer import PromptTokenizer
from server.tokenize_pool import PoolFull, TokenizePool

# Uncached characters tokenized on the loop: a few ms at most (64k characters took 27 ms).
INLINE_UNCACHED_CHARS = 8192
# Chat templates render on the loop up to this size (0.05 ms for 256k characters in 40 messages).
INLINE_TEMPLATE_CHARS = 1 << 20
INLINE_TEMPLATE_MESSAGES = 1024
# Token ids turned into vocabulary strings on the loop (about 0.3 us each); more go to the pool.
INLINE_TOKEN_STRINGS = 4096
# A request's prompts together may hold at most this many full contexts (the default of
# `max_request_tokens`): the engine admits a request's prompts all or none, and one request's
# tokenizing should stay one job's worth (a big batch is many requests).
REQUEST_CONTEXTS = 32


class PromptBuilder:
    """Turns `prompt` fields and chat messages into token-id prompts; `close()` at shutdown."""

    def __init__(self, codec: PromptCodec, prompt_tokenizer: PromptTokenizer, max_model_len: int,
                 pool: TokenizePool, on_overloaded: Callable[[], None],
                 max_request_tokens: int | None = None) -> None:
        self._codec = codec
        self._on_overloaded = on_overloaded
        self.prompt_tokenizer = prompt_tokenizer
        self.max_model_len = max_model_len
        self.max_request_tokens = max_request_tokens or REQUEST_CONTEXTS * max_model_len
        self._pool = pool

    async def completion(self, prompt: Any, tenant: str,
                         add_special_tokens: bool = True) -> list[list[int]]:
        """The prompts of a /v1/completions body: a string, strings, token ids or lists of them
        (``add_special_tokens``: the tokenizer's BOS and the like around a text prompt)."""
        if isinstance(prompt, str):
            return [await self.text(prompt, tenant, add_special_tokens)]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return await self._texts(prompt, tenant, add_special_tokens)
        return [list(p) for p in prompt]

    async def text(self, text: str, tenant: str, add_special_tokens: bool = True,
                   param: str = "prompt") -> list[int]:
        """One text prompt: its length checked on characters, then tokenized."""
        self._check_chars(len(text), param)  # on the loop: cheap, and nothing queued for it
        return await self._encode(text, add_special_tokens, tenant)

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   tenant: str, template_kwargs: dict[str, Any] | None = None, *,
                   add_special_tokens: bool = False) -> list[int]:
        """The prompt of a chat: the template rendered (with `template_kwargs` as variables),
        checked, then tokenized (the post-processor's specials added if asked: /tokenize)."""
        kwargs = template_kwargs or {}
        # the template renders the tools too: a large list of them goes to the pool as well
        num_chars = sum(len(m["content"]) for m in messages) + len(str(kwargs.get("tools", "")))
        if len(messages) > INLINE_TEMPLATE_MESSAGES or num_chars > INLINE_TEMPLATE_CHARS:
            return await self._run(self._chat_job, messages, add_generation_prompt, tenant,
                                   kwargs, add_special_tokens)
        text = self._render(messages, add_generation_prompt, kwargs)
        return await self._encode(text, add_special_tokens, tenant)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary string; a long list is built on the pool."""
        if len(token_ids) <= INLINE_TOKEN_STRINGS:
            return self._codec.token_strings(token_ids)
        return await self._run(self._codec.token_strings, token_ids)

    def close(self) -> None:
        """Stop the pool's workers."""
        self._pool.close()

    # ---- the work ------------------------------------------------------------------------
    async def _texts(self, texts: list[str], tenant: str,
                     add_special_tokens: bool = True) -> list[list[int]]:
        num_chars = 0
        for text in texts:
            self._check_chars(len(text), "prompt")
            num_chars += len(text)
        self._check_request_chars(num_chars, len(texts))
        if num_chars <= INLINE_UNCACHED_CHARS:
            return self._texts_job(texts, tenant, add_special_tokens)
        return await self._run(self._texts_job, texts, tenant, add_special_tokens)

    def _texts_job(self, texts: list[str], tenant: str,
                   add_special_tokens: bool) -> list[list[int]]:
        return [self.prompt_tokenizer.encode(text, add_special_tokens, tenant) for text in texts]

    async def _encode(self, text: str, add_special_tokens: bool, tenant: str) -> list[int]:
        if self.prompt_tokenizer.num_uncached_chars(text, tenant) <= INLINE_UNCACHED_CHARS:
            return self.prompt_tokenizer.encode(text, add_special_tokens, tenant)
        return await self._run(self.prompt_tokenizer.encode, text, add_special_tokens, tenant)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                kwargs: dict[str, Any]) -> str:
        try:
            text = self._codec.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # a template can reject a conversation (e.g. role order)
            raise APIError(400, f"chat template failed: {exc}", param="messages") from exc
        # The rendered text, not the messages: a template may drop parts of them.
        self._check_chars(len(text), "messages")
        return text

    def _chat_job(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                  tenant: str, kwargs: dict[str, Any], add_special_tokens: bool) -> list[int]:
        text = self._render(messages, add_generation_prompt, kwargs)
        return self.prompt_tokenizer.encode(text, add_special_tokens, tenant)

    async def _run(self, fn: Any, *args: Any) -> Any:
        try:
            return await self._pool.run(fn, *args)
        except PoolFull as exc:
            self._on_overloaded()
            raise APIError(503, f"server is overloaded: {exc}", code="overloaded") from exc

    def _check_chars(self, num_chars: int, param: str) -> None:
        at_least = self.prompt_tokenizer.min_num_tokens(num_chars)
        if at_least >= self.max_model_len:
            raise APIError(
                400, f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has at least {at_least} tokens ({num_chars} characters; at least "
                "one token must be left to generate)", param=param,
                code="context_length_exceeded")

    def _check_request_chars(self, num_chars: int, num_prompts: int) -> None:
        at_least = self.prompt_tokenizer.min_num_tokens(num_chars)
        if at_least > self.max_request_tokens:
            raise APIError(
                413, f"a request's prompts may hold at most {self.max_request_tokens} tokens "
                f"together; these {num_prompts} prompts have at least {at_least} tokens "
                f"({num_chars} characters): send them in several requests",
                param="prompt", code="request_too_large")
