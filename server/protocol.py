"""Pydantic models of the OpenAI request bodies (plus vLLM's extras: top_k, cache_salt)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

MAX_N = 128

# Strict number types: "0.5" or true for temperature is a client bug, answered with 400.
Temperature = Annotated[float, Field(ge=0.0, le=2.0, strict=True)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, strict=True)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, strict=True)]
TokenId = Annotated[int, Field(ge=0, strict=True)]


class StreamOptions(BaseModel):
    """`stream_options`: only include_usage has meaning here."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

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
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    best_of: StrictInt | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops or None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("cache_salt must not be empty when given")
        return value


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1, strict=True)] | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
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

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
