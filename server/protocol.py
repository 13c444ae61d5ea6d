"""Pydantic models of the OpenAI request bodies, plus the vLLM extras kvengine implements.

A field that is neither declared here nor in PASSTHROUGH_FIELDS is refused with 400 (serving.py
checks `model_extra`): a client must never get silently different output because we ignored
what it asked for. A field sent as null counts as not sent.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_TOKEN_ID_ITEMS,
    check_stop_budget,
    check_token_id_items,
)

MAX_N = 128

# Accepted and ignored: OpenAI bookkeeping that changes nothing in the generated output.
PASSTHROUGH_FIELDS = frozenset({
    "user",  # an end-user id for abuse monitoring
    "service_tier",  # OpenAI's latency tier; one tier here
    "metadata",  # tags for OpenAI's stored completions
    "store",  # OpenAI's stored completions (nothing is stored)
})

# Strict number types: "0.5" or true for temperature is a client bug, answered with 400.
Temperature = Annotated[float, Field(ge=0.0, le=2.0, strict=True)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, strict=True)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, strict=True)]
TokenId = Annotated[int, Field(ge=0, strict=True)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS, strict=True)]


class StreamOptions(BaseModel):
    """`stream_options`: only include_usage has meaning here."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


def _lone_surrogate_path(value: Any, path: str) -> str | None:
    """Where in a parsed JSON value a string holds a lone surrogate (not encodable text)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate_path(key, path) or _lone_surrogate_path(
                item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_path(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


_TOKEN_ID_COLLECTIONS = ("logit_bias", "stop_token_ids")  # at most MAX_TOKEN_ID_ITEMS each


def _oversized(value: Any) -> bool:
    return isinstance(value, (dict, list)) and len(value) > MAX_TOKEN_ID_ITEMS


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are kept in `model_extra` for the
    serving layer to refuse (or pass, see PASSTHROUGH_FIELDS)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # An oversized token-id collection is refused by its field (``_bounded``) before any of
        # its items, or the dump below, costs time on the event loop.
        if isinstance(data, dict) and any(_oversized(data.get(n)) for n in _TOKEN_ID_COLLECTIONS):
            return data
        # JSON may escape lone surrogates ("\ud800"); Python's parser accepts them, but no
        # tokenizer or hash can take such a string. One C-speed dump finds them; a 400, not a 500.
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            where = _lone_surrogate_path(data, "")
            raise ValueError(f"{where}: not valid Unicode text (a lone surrogate)") from None
        except (TypeError, ValueError):
            pass  # not JSON-like input: the field validators say what is wrong
        return data

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1, strict=True)] | None = None  # vLLM: -1 or 0 = off
    n: Annotated[int, Field(ge=1, le=MAX_N, strict=True)] = 1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    cache_salt: str | None = None
    return_tokens_as_token_ids: StrictBool | None = None  # vLLM: logprobs name "token_id:{id}"
    # vLLM's: per prompt token its logprob and N alternatives (serving.py bounds N, as vLLM)
    prompt_logprobs: StrictInt | None = None
    # vLLM's request extras: priority (0 only: first come, first served), the client's id for
    # the response, and the prompt cut to its last N tokens (-1: to the context length)
    priority: StrictInt = 0
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, strict=True)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    best_of: StrictInt | None = None
    user: str | None = None
    # vLLM's sampling extras (engine.SamplingParams says what each does)
    min_p: Annotated[float, Field(ge=0.0, le=1.0, strict=True)] | None = None
    repetition_penalty: Annotated[float, Field(ge=1e-3, le=1e3, strict=True)] | None = None
    min_tokens: Annotated[int, Field(ge=0, strict=True)] = 0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, strict=True)]] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Structured outputs (server/structured_outputs.py reads them): OpenAI's response_format,
    # vLLM's structured_outputs and its older guided_* fields; at most one may be given.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator(*_TOKEN_ID_COLLECTIONS, mode="before")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """At most MAX_TOKEN_ID_ITEMS, counted before a single item is validated (on the event
        loop: 300,000 logit_bias entries held every other request for 0.8 s)."""
        if isinstance(value, (dict, list)):
            check_token_id_items(info.field_name, len(value))
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or ():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (as strings), got {key!r}")
        return value

    def unsupported_fields(self) -> list[str]:
        """Fields the client sent that kvengine neither implements nor may ignore."""
        extra = self.model_extra or {}
        return sorted(k for k, v in extra.items() if v is not None and k not in PASSTHROUGH_FIELDS)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        check_stop_budget(stops)
        return stops or None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1, or -1 (the context "
                             "length)")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("cache_salt must not be empty when given")
        return value


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # 0 only with echo (vLLM's scoring request: the prompt and its logprobs, nothing generated)
    max_tokens: Annotated[int, Field(ge=0, strict=True)] | None = 16
    echo: StrictBool = False  # the prompt in front of the text (and its logprobs, with logprobs)
    logprobs: NumLogprobs | None = None  # N alternatives per token (0: the token's own only)
    add_special_tokens: StrictBool = True  # vLLM: the tokenizer's BOS and the like
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            value = handler(value)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids "
                "(non-negative integers) or a list of such lists") from None
        if isinstance(value, list) and (
            not value or any(not isinstance(p, int) and not p for p in value)
        ):
            raise ValueError("prompt must not be empty")
        return value


class TextPart(BaseModel):
    """A content part of a chat message; only text is understood."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # history fields chat templates read (Qwen3: reasoning_content; tool results and calls);
    # vLLM 0.32's clients send the reasoning back as ``reasoning``
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_fields(self) -> dict[str, Any]:
        """The message as the chat template sees it: role, content text, and what else was set."""
        fields: dict[str, Any] = {"role": self.role, "content": self.text()}
        for name in ("name", "reasoning_content", "tool_calls", "tool_call_id"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.reasoning is not None and self.reasoning_content is None:
            fields["reasoning_content"] = self.reasoning
        return fields

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: NumLogprobs | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None  # None: True, as OpenAI's default
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False  # vLLM: the template writes them already
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
