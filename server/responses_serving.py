"""ResponsesServing: POST /v1/responses answered by the chat path, shaped as OpenAI's Responses.

The request becomes a chat request (``ResponsesRequest.chat_request``) served by
``OpenAIServing.chat``: same tokenization, tools, grammars, reasoning parser, tenants and KV
reuse. Its answer is reshaped: the reasoning (under ``--reasoning-parser``) a ``reasoning`` item,
the text a ``message`` item with one ``output_text`` part, each tool call a ``function_call``
item; a stream's chat chunks become the Responses events as they arrive
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``, ...,
``response.completed``), each with its ``sequence_number``. An answer cut by
``max_output_tokens`` is ``incomplete``; an error before the answer starts is the chat path's
error response, unchanged.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api_error import APIError
from server.protocol import ChatCompletionRequest
from server.responses_protocol import ResponsesRequest
from server.serving import OpenAIServing
from server.streaming import EventStreamResponse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServing:
    """The Responses API over one OpenAIServing."""

    def __init__(self, serving: OpenAIServing,
                 prepare: Callable[[ChatCompletionRequest], ChatCompletionRequest]) -> None:
        self.serving = serving
        self._prepare = prepare  # the app's model aliases and generation_config defaults

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        try:
            chat = self._prepare(body.chat_request())
        except (ValueError, ValidationError) as exc:
            raise APIError(400, _problems(exc) if isinstance(exc, ValidationError)
                           else str(exc)) from None
        shape = _Shape(body, self.serving.model_name)
        reply = await self.serving.chat(chat, request)
        if reply.status_code != 200:
            return reply
        if not body.stream:
            return JSONResponse(shape.from_chat_body(json.loads(bytes(reply.body))))
        assert isinstance(reply, EventStreamResponse)
        return reply.mapped(lambda chunks: shape.events(chunks))


class _Shape:
    """One response's identity and the request fields it echoes."""

    def __init__(self, body: ResponsesRequest, model_name: str) -> None:
        self.body = body
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model_name
        self.seq = 0

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, finish_reason: str | None = None) -> dict:
        b = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "instructions": b.instructions, "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "temperature": b.temperature, "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens, "previous_response_id": None,
            "reasoning": b.reasoning, "store": False, "truncation": "disabled",
            "text": b.text or {"format": {"type": "text"}}, "user": b.user,
            "usage": None if usage is None else _usage(usage),
        }

    def from_chat_body(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            output.append(_reasoning_item(_id("rs"), reasoning, "completed"))
        if message.get("content"):
            output.append(_message_item(_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            output.append(_call_item(_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        status = _status(choice.get("finish_reason"))
        _close_items(output, status)
        return self.response(status, output, chat.get("usage"))

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode()

    async def events(self, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """The Responses events for a chat stream's chunks."""
        items: list[dict[str, Any]] = []  # output items in order, as they stand
        text: dict[str, Any] | None = None
        thought: dict[str, Any] | None = None
        calls: dict[int, dict[str, Any]] = {}
        usage = finish = None
        start = self.response("in_progress", [], None)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        try:
            async for chunk in chunks:
                data = _data(chunk)
                if data is None:
                    continue
                if "error" in data:
                    error = data["error"]
                    yield self._event("error", code=error.get("code"),
                                      message=error.get("message"), param=error.get("param"))
                    failed = self.response("failed", items, usage)
                    failed["error"] = {"code": "server_error", "message": error.get("message")}
                    yield self._event("response.failed", response=failed)
                    return
                usage = data.get("usage") or usage
                for choice in data.get("choices") or []:
                    delta = choice.get("delta") or {}
                    finish = choice.get("finish_reason") or finish
                    piece = delta.get("reasoning_content") or delta.get("reasoning")
                    if piece:
                        if thought is None:
                            thought = _reasoning_item(_id("rs"), "", "in_progress")
                            items.append(thought)
                            yield self._event("response.output_item.added",
                                              output_index=len(items) - 1, item=thought)
                        thought["content"][0]["text"] += piece
                        yield self._event("response.reasoning_text.delta", item_id=thought["id"],
                                          output_index=items.index(thought), content_index=0,
                                          delta=piece)
                    if delta.get("content"):
                        if text is None:
                            text = _message_item(_id("msg"), "", "in_progress")
                            items.append(text)
                            index = len(items) - 1
                            yield self._event("response.output_item.added", output_index=index,
                                              item=text)
                            yield self._event("response.content_part.added", item_id=text["id"],
                                              output_index=index, content_index=0,
                                              part=dict(text["content"][0]))
                        text["content"][0]["text"] += delta["content"]
                        yield self._event("response.output_text.delta", item_id=text["id"],
                                          output_index=items.index(text), content_index=0,
                                          delta=delta["content"], logprobs=[])
                    for call in delta.get("tool_calls") or []:
                        item = calls.get(call.get("index", 0))
                        function = call.get("function") or {}
                        if item is None:
                            item = _call_item(_id("fc"), call.get("id") or _id("call"),
                                              function.get("name") or "", "", "in_progress")
                            calls[call.get("index", 0)] = item
                            items.append(item)
                            yield self._event("response.output_item.added",
                                              output_index=len(items) - 1, item=dict(item))
                        if function.get("arguments"):
                            item["arguments"] += function["arguments"]
                            yield self._event("response.function_call_arguments.delta",
                                              item_id=item["id"], output_index=items.index(item),
                                              delta=function["arguments"])
        finally:
            await chunks.aclose()
        status = _status(finish)
        _close_items(items, status)
        for index, item in enumerate(items):
            if item is text:
                part = item["content"][0]
                yield self._event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=part["text"],
                                  logprobs=[])
                yield self._event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=part)
            elif item is thought:
                yield self._event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=index, content_index=0,
                                  text=item["content"][0]["text"])
            else:
                yield self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)
        yield self._event(f"response.{status}", response=self.response(status, items, usage))


def _status(finish_reason: str | None) -> str:
    """A response cut by its token limit is incomplete (OpenAI's), else completed."""
    return "incomplete" if finish_reason == "length" else "completed"


def _close_items(items: list[dict[str, Any]], status: str) -> None:
    """The items' final status: in an incomplete response the last one, where the limit cut
    the answer, is incomplete too (as OpenAI's), and so is a function call whose arguments the
    limit left unfinished (a stream announces a call before its arguments are whole); the
    others completed."""
    for index, item in enumerate(items):
        cut = index == len(items) - 1 or _unfinished_call(item)
        item["status"] = "incomplete" if status == "incomplete" and cut else "completed"


def _unfinished_call(item: dict[str, Any]) -> bool:
    if item.get("type") != "function_call":
        return False
    try:
        json.loads(item.get("arguments") or "")
    except ValueError:
        return True
    return False


def _problems(exc: ValidationError) -> str:
    """What the chat request made of a response's fields refused, by field (pydantic's first
    line names only the model)."""
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])


def _data(chunk: bytes) -> dict[str, Any] | None:
    """The JSON of one chat SSE chunk (``data: {...}``), None for ``[DONE]``."""
    payload = chunk.decode().strip()
    if not payload.startswith("data: ") or payload == "data: [DONE]":
        return None
    return json.loads(payload[len("data: "):])


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0)}
