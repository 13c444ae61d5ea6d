"""The status of a Responses answer's output items (``server/responses_serving.py``), streamed
and not: in an answer cut by its token limit the item the limit cut is incomplete, as OpenAI's,
and so is a function call announced before its arguments were whole; the items before are
completed. (The whole API runs against a real server in test_responses_api.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

from server.responses_protocol import ResponsesRequest
from server.responses_serving import _Shape


def _shape() -> _Shape:
    return _Shape(ResponsesRequest(model="tiny", input="hi"), "tiny")


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def _events(chunks: list[bytes]) -> list[dict]:
    async def source() -> AsyncGenerator[bytes, None]:
        for chunk in chunks:
            yield chunk

    async def collect() -> list[bytes]:
        return [event async for event in _shape().events(source())]

    return [json.loads(e.decode().split("data: ", 1)[1]) for e in asyncio.run(collect())]


def test_a_cut_answer_marks_only_its_last_item_incomplete() -> None:
    chat = {"choices": [{"message": {"reasoning_content": "think", "content": "an ans"},
                         "finish_reason": "length"}], "usage": None}
    reply = _shape().from_chat_body(chat)
    assert reply["status"] == "incomplete"
    assert [(i["type"], i["status"]) for i in reply["output"]] == [
        ("reasoning", "completed"), ("message", "incomplete")]
    chat["choices"][0]["finish_reason"] = "stop"
    assert [i["status"] for i in _shape().from_chat_body(chat)["output"]] == ["completed"] * 2


def test_a_cut_stream_marks_the_cut_item_and_an_unfinished_call_incomplete() -> None:
    events = _events([
        _chunk({"reasoning_content": "think"}),
        _chunk({"tool_calls": [{"index": 0, "id": "c0", "function": {
            "name": "f", "arguments": '{"a": 1}'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "c1", "function": {
            "name": "g", "arguments": '{"b'}}]}),
        _chunk({"content": "<tool_call>"}, finish="length")])
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [
        ("reasoning", "completed"), ("function_call", "completed"),
        ("function_call", "incomplete"), ("message", "incomplete")]
    assert events[-1]["type"] == "response.incomplete"
    assert [i["status"] for i in events[-1]["response"]["output"]] == [
        i["status"] for i in done]


def test_a_whole_stream_is_completed_throughout() -> None:
    events = _events([_chunk({"content": "hello"}), _chunk({}, finish="stop")])
    assert events[-1]["type"] == "response.completed"
    assert [i["status"] for i in events[-1]["response"]["output"]] == ["completed"]
