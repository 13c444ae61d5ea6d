"""Tool-call and reasoning parsers against outputs in the real formats, whole and streamed.

The texts are what Qwen3 (hermes) and Llama 3.1 (llama3_json) write: a call after some text, two
parallel calls, a malformed call (left as text), plain text. Streamed, every text is fed in
pieces of every size from 1 to 7 characters; the deltas must add up to the whole message.
"""

from __future__ import annotations

import json

import pytest

from server.chat_output import ChatOutput, ChatShape
from server.reasoning_parsers import Qwen3ReasoningParser
from server.tool_parsers import HermesToolParser, Llama3JsonToolParser, json_value_end

HERMES_ONE = ('Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Zürich", "unit": "c"}}\n</tool_call>')
HERMES_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
              '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Oslo", '
              '"note": "a \\"quoted\\" }"}}\n</tool_call>')
HERMES_BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
LLAMA_TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_time", "parameters": {"tz": "UTC"}}')
LLAMA_BROKEN = '{"name": "get_weather", "parameters": {"city": }'

CASES = [
    (HermesToolParser, HERMES_ONE, "Let me check the weather.\n",
     [("get_weather", {"city": "Zürich", "unit": "c"})]),
    (HermesToolParser, HERMES_TWO, None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Oslo",
                                                        "note": 'a "quoted" }'})]),
    (HermesToolParser, HERMES_BROKEN, HERMES_BROKEN, []),
    (HermesToolParser, "Just an answer <tool_ no call.", "Just an answer <tool_ no call.", []),
    (Llama3JsonToolParser, LLAMA_ONE, None, [("get_weather", {"city": "Paris", "days": 3})]),
    (Llama3JsonToolParser, LLAMA_TWO, None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    (Llama3JsonToolParser, LLAMA_BROKEN, LLAMA_BROKEN, []),
    (Llama3JsonToolParser, "The weather is fine.", "The weather is fine.", []),
]


@pytest.mark.parametrize(("parser_cls", "text", "content", "calls"), CASES)
def test_whole_outputs(parser_cls, text: str, content: str | None, calls: list) -> None:
    message = ChatOutput(None, parser_cls()).message(text)
    assert message["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in message.get("tool_calls", [])]
    assert got == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function"
               for c in message.get("tool_calls", []))


def _streamed(output: ChatOutput, text: str, step: int) -> dict:
    """Feed ``text`` in pieces of ``step`` characters; the message the deltas add up to."""
    content, reasoning, calls = "", "", {}
    for end in [*range(step, len(text), step), len(text)]:
        for delta in output.deltas(text[:end], final=end == len(text)):
            content += delta.get("content", "")
            reasoning += delta.get("reasoning_content", "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
                if "id" in call:
                    assert entry["name"] is None, "a call's first delta came twice"
                    entry["name"] = call["function"]["name"]
                    assert call["function"]["arguments"] == ""
                else:
                    entry["arguments"] += call["function"]["arguments"]
    return {"content": content, "reasoning": reasoning,
            "calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("step", range(1, 8))
@pytest.mark.parametrize(("parser_cls", "text", "content", "calls"), CASES)
def test_streamed_outputs_add_up_to_the_whole(parser_cls, text: str, content: str | None,
                                              calls: list, step: int) -> None:
    got = _streamed(ChatOutput(None, parser_cls()), text, step)
    assert got["content"] == (content or "")
    if not calls and got["calls"]:  # a malformed call announced before it broke: still text
        assert got["content"] == text
        return
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == calls
    whole = ChatOutput(None, parser_cls()).message(text).get("tool_calls", [])
    assert [c["arguments"] for c in got["calls"]] == [c["function"]["arguments"] for c in whole]


REASONING = [
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n",
     "\n\nIt is 4."),
    ("It is 4.", None, "It is 4."),
    ("<think>\nStill thinking about <thi", "\nStill thinking about <thi", ""),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), REASONING)
def test_qwen3_reasoning(text: str, reasoning: str | None, content: str) -> None:
    message = ChatOutput(Qwen3ReasoningParser(), None).message(text)
    assert message.get("reasoning_content") == reasoning and message["content"] == content
    for step in (1, 3, 5):
        got = _streamed(ChatOutput(Qwen3ReasoningParser(), None), text, step)
        assert (got["reasoning"], got["content"]) == (reasoning or "", content)


def test_reasoning_then_tool_call() -> None:
    text = "<think>\nI need the weather.\n</think>\n\n" + HERMES_ONE
    message = ChatOutput(Qwen3ReasoningParser(), HermesToolParser()).message(text)
    assert message["reasoning_content"] == "\nI need the weather.\n"
    assert message["content"] == "\n\nLet me check the weather.\n"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    got = _streamed(ChatOutput(Qwen3ReasoningParser(), HermesToolParser()), text, 2)
    assert got["reasoning"] == message["reasoning_content"]
    assert got["calls"][0]["arguments"] == message["tool_calls"][0]["function"]["arguments"]


def test_finish_reasons() -> None:
    auto = ChatShape(None, HermesToolParser(), named=False)
    assert auto.message("r0", HERMES_ONE, "stop")[1] == "tool_calls"
    assert auto.message("r1", "no call", "stop")[1] == "stop"
    assert auto.message("r2", HERMES_ONE, "length")[1] == "length"
    named = ChatShape(None, HermesToolParser(), named=True)
    assert named.message("r0", HERMES_ONE, "stop")[1] == "stop"  # as OpenAI's named choice
    chunks = auto.chunks("s", HERMES_ONE, True, "stop")
    assert chunks[-1][1] == "tool_calls" and all(r is None for _, r in chunks[:-1])


@pytest.mark.parametrize(("text", "end"), [('{"a": [1, "}"]} tail', 15), ('"x\\"y" ', 6),
                                           ("12, 3", 2), ('{"a": ', None), ("tru", None)])
def test_json_value_end(text: str, end: int | None) -> None:
    assert json_value_end(text, 0) == end
