"""ResponsesRequest: POST /v1/responses (OpenAI's Responses API, as vLLM 0.32 serves it) and its
translation into the chat request kvengine serves it by.

``input`` is a string (one user message) or a list of items: messages (``role`` and ``content``,
a string or ``input_text`` / ``output_text`` parts), ``function_call`` items (the model's
earlier calls: consecutive ones become one assistant message's ``tool_calls``) and
``function_call_output`` items (tool messages); ``reasoning`` items of earlier turns are dropped
(the chat templates keep no reasoning of past turns either). ``instructions`` is a system message
first. Function tools map to chat tools, ``text.format`` to ``response_format``,
``max_output_tokens`` to ``max_completion_tokens``, ``prompt_cache_key`` to ``cache_salt`` (as
vLLM maps it). Nothing is stored: ``store`` is answered ``false`` (as vLLM without its
responses store) and ``previous_response_id`` is refused, since there is no earlier response to
continue from. A field this API has that kvengine does not honour is refused with 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from server.protocol import ChatCompletionRequest, Temperature, TopP

PASSTHROUGH = frozenset({"user", "metadata", "service_tier", "store", "truncation", "include",
                         "parallel_tool_calls", "background"})


class ResponsesRequest(BaseModel):
    """POST /v1/responses; unknown fields are kept in ``model_extra`` and refused."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    background: StrictBool | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request that answers this one (ValueError: a field it cannot honour)."""
        unknown = sorted(k for k, v in (self.model_extra or {}).items() if v is not None)
        if unknown:
            raise ValueError(f"unsupported request field(s): {', '.join(unknown)}")
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: kvengine stores no responses; send the "
                             "conversation's items in input")
        if self.background:
            raise ValueError("background: responses are answered in the request, not queued")
        if self.include:
            raise ValueError(f"include: {self.include} is not available here")
        if self.reasoning not in (None, {}) and set(self.reasoning) - {"effort", "summary"}:
            raise ValueError(f"reasoning: unsupported keys {sorted(self.reasoning)}")
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "cache_salt": self.prompt_cache_key, "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = _response_format((self.text or {}).get("format"))
        if response_format is not None:
            body["response_format"] = response_format
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item.get("role"), "content": _text(item, i)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function", "function": {
                    "name": item.get("name"), "arguments": item.get("arguments", "")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                        and not last.get("content"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str)
                                 else json.dumps(output)})
            elif kind != "reasoning":
                raise ValueError(f"input[{i}]: items of type {kind!r} are not supported "
                                 "(messages, function_call, function_call_output, reasoning)")
        return messages


def _text(item: dict[str, Any], index: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{index}].content must be a string or a list of parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                  "text"):
            raise ValueError(f"input[{index}].content: only text parts are understood")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"tools: only function tools are served, not {tool.get('type')!r}")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice {choice!r} is not supported")


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is not None and not isinstance(fmt, dict):
        raise ValueError(f"text.format must be an object such as {{\"type\": \"json_object\"}}, "
                         f"got {type(fmt).__name__}")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ValueError(f"text.format of type {fmt.get('type')!r} is not supported")
