"""/tokenize and /detokenize with vLLM's request and response shapes.

A text prompt is tokenized exactly as /v1/completions would tokenize it (the same tenant cache),
a chat as /v1/chat/completions renders and tokenizes it, so the counts a client gets here are the
counts the engine sees: through the same PromptBuilder, so with the same early length check on
characters (a text that cannot fit the context is refused before tokenizing) and the same bounded
pool for large work. Token strings come from the tokenizer's vocabulary, a long list of them
built on that pool too.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from starlette.requests import Request

from server.api_error import APIError
from server.auth import KEY_SALT_SCOPE, tenant_salt
from server.chat_tools import template_inputs
from server.engine_protocol import PromptCodec
from server.prompt_builder import PromptBuilder
from server.protocol import ChatMessage

TokenId = Annotated[int, Field(ge=0, strict=True)]
# A /detokenize body's bound before parsing: an id as JSON takes at most 11 bytes with its
# comma (2**31 - 1), a few more for spaces; plus the model name and the braces.
DETOKENIZE_BYTES_PER_TOKEN = 16
DETOKENIZE_BODY_SLACK = 4096


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a text `prompt`."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with chat `messages` (rendered by the chat template first)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False
    # vLLM's too: the template renders them as the chat endpoint does
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class TokenizationServing:
    """The two endpoints over the engine's tokenizer and the server's prompt builder."""

    def __init__(self, codec: PromptCodec, prompts: PromptBuilder, model_names: frozenset[str],
                 max_model_len: int, vocab_size: int) -> None:
        self._codec = codec
        self._prompts = prompts
        self._model_names = model_names
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest,
                       request: Request) -> dict[str, Any]:
        """The token ids (and strings) of a prompt or a chat."""
        self._check_model(body.model)
        tenant = tenant_salt(request.scope.get(KEY_SALT_SCOPE, ""), None)
        # The endpoints' own paths: checked on characters first, tokenized on the bounded pool
        # when large (never on the loop, never by an unbounded number of threads).
        if isinstance(body, TokenizeChatRequest):
            messages, kwargs = template_inputs(
                [m.template_fields() for m in body.messages], body.chat_template_kwargs,
                body.tools)
            tokens = await self._prompts.chat(messages, body.add_generation_prompt, tenant,
                                              kwargs, add_special_tokens=body.add_special_tokens)
        else:
            tokens = await self._prompts.text(body.prompt, tenant, body.add_special_tokens)
        out: dict[str, Any] = {"count": len(tokens), "max_model_len": self._max_model_len,
                               "tokens": tokens}
        if body.return_token_strs:
            out["token_strs"] = await self._prompts.token_strings(tokens)
        return out

    async def detokenize(self, raw: bytes) -> dict[str, Any]:
        """The text of the token ids in a raw /detokenize body, special tokens included (as
        vLLM decodes them). At most ``max_model_len`` ids: a body longer than that many ids
        can be is refused before it is parsed (1.2M ids, 3.6 MB, took the event loop 0.63 s
        to parse and range-check), the rest checked after."""
        limit = DETOKENIZE_BYTES_PER_TOKEN * self._max_model_len + DETOKENIZE_BODY_SLACK
        if len(raw) > limit:
            raise APIError(400, f"/detokenize takes at most {self._max_model_len} token ids "
                           f"(the context length); this body has {len(raw)} bytes, more than "
                           f"{limit} ids of any size could take", param="tokens")
        try:
            body = DetokenizeRequest.model_validate_json(raw)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from None
        self._check_model(body.model)
        if len(body.tokens) > self._max_model_len:
            raise APIError(400, f"/detokenize takes at most {self._max_model_len} token ids "
                           f"(the context length), got {len(body.tokens)}", param="tokens")
        if body.tokens and max(body.tokens) >= self._vocab_size:
            too_big = next(t for t in body.tokens if t >= self._vocab_size)
            raise APIError(400, f"token id {too_big} is out of range: the vocabulary has "
                           f"{self._vocab_size} tokens", param="tokens")
        text = await asyncio.to_thread(self._codec.decode, body.tokens, False)
        return {"prompt": text}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self._model_names:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                           f"{', '.join(sorted(self._model_names))}", param="model",
                           code="model_not_found")
