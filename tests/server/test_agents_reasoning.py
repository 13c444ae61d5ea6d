"""Thinking before a forced tool call or a structured output: a real `kvengine serve
--reasoning-parser qwen3 --tool-call-parser hermes` on the thinking variant of the tiny model
(``<think>`` and ``</think>`` as tokens of their own, Qwen3's ``enable_thinking`` switch in the
template; tests/support/thinking_model.py).

The weights are random, so the model only thinks when told to: ``logit_bias`` makes
``<think>`` its first token and ``</think>`` come a few tokens later, and a repetition penalty
(applied after the bias) keeps ``<think>`` from coming back. Everything after ``</think>`` is
the grammar's doing; before it the output is free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from support.kvengine import KvengineProcess
from support.thinking_model import write_thinking_model

CITY = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Zürich", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [CITY, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Zürich?"}]
ARGS = ("--served-model-name", "tiny", "--max-model-len", "2048", "--num-kv-blocks", "256",
        "--seed", "0", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory,
                   tiny_model_dir: Path) -> tuple[Path, int, int]:
    out = tmp_path_factory.mktemp("thinking") / "model"
    return (out, *write_thinking_model(tiny_model_dir, out))


@pytest.fixture(scope="module")
def oai(thinking_model: tuple[Path, int, int]) -> Iterator[openai.OpenAI]:
    with KvengineProcess("--model", str(thinking_model[0]), *ARGS,
                         "--reasoning-parser", "qwen3") as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                          timeout=120) as client:
        yield client


def _think_first(thinking_model: tuple[Path, int, int], end_bias: float | None = 6.0) -> dict:
    """Request fields that make the random model open a thinking block and (with
    ``end_bias``) close it after a few free tokens."""
    _, start_id, end_id = thinking_model
    bias = {str(start_id): 20} | ({} if end_bias is None else {str(end_id): end_bias})
    return {"logit_bias": bias, "extra_body": {"repetition_penalty": 1000.0}}


def _check_call(call: object, names: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(stream: Iterator) -> tuple[str, str, dict[int, dict], str | None]:
    """(reasoning_content, content, calls by index, finish_reason) of a chat stream."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        for part in choice.delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": None, "arguments": ""})
            if part.id:
                entry["name"] = part.function.name
            entry["arguments"] += part.function.arguments or ""
    return reasoning, content, calls, finish


def test_a_forced_call_after_the_reasoning(oai: openai.OpenAI, thinking_model) -> None:
    """tool_choice required: reasoning_content holds the thought, tool_calls the call that the
    grammar forced after ``</think>``; streamed, the same parts in deltas."""
    request = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=7,
                   **_think_first(thinking_model))
    choice = oai.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning.strip() and "think>" not in reasoning  # free tokens, thought first
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    _check_call(call, {"get_weather", "get_time"})
    streamed = _streamed(oai.chat.completions.create(**request, stream=True))
    assert streamed[0] == reasoning and not streamed[1].strip()
    assert streamed[2] == {0: {"name": call.function.name,
                               "arguments": call.function.arguments}}
    assert streamed[3] == "tool_calls"


def test_a_json_schema_after_the_reasoning(oai: openai.OpenAI, thinking_model) -> None:
    schema = SCHEMAS["get_weather"]
    message = oai.chat.completions.create(
        model="tiny", messages=USER, max_tokens=300, temperature=1.0, seed=8,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        **_think_first(thinking_model)).choices[0].message
    assert message.model_extra["reasoning_content"].strip()
    jsonschema.validate(json.loads(message.content), schema)


def test_enable_thinking_false_constrains_at_once(oai: openai.OpenAI) -> None:
    """The template writes the empty thinking block into the prompt: no reasoning, the named
    call and the schema from the first token."""
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    named = oai.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=200, temperature=1.0, seed=9,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body=no_thinking).choices[0]
    assert named.finish_reason == "stop" and not named.message.content
    assert named.message.model_extra.get("reasoning_content") is None
    (call,) = named.message.tool_calls
    _check_call(call, {"get_time"})
    schema = SCHEMAS["get_weather"]
    answer = oai.chat.completions.create(
        model="tiny", messages=USER, max_tokens=200, temperature=1.0, seed=9,
        extra_body={**no_thinking, "structured_outputs": {"json": schema}}).choices[0].message
    assert answer.content.startswith("{")
    jsonschema.validate(json.loads(answer.content), schema)


def test_thinking_that_runs_out_of_tokens_claims_no_call(oai: openai.OpenAI,
                                                         thinking_model) -> None:
    request = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                   max_tokens=8, temperature=1.0, seed=7,
                   **_think_first(thinking_model, end_bias=None))
    choice = oai.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls and not choice.message.content
    assert choice.message.model_extra["reasoning_content"].strip()
    reasoning, content, calls, finish = _streamed(
        oai.chat.completions.create(**request, stream=True))
    assert (reasoning, content, calls, finish) == (
        choice.message.model_extra["reasoning_content"], "", {}, "length")


def test_without_the_reasoning_parser_the_call_is_forced_from_the_first_token(
        thinking_model) -> None:
    """The same request to a server without --reasoning-parser: the grammar starts at once,
    so the biased ``<think>`` never comes out."""
    with KvengineProcess("--model", str(thinking_model[0]), *ARGS) as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                          timeout=120) as client:
        choice = client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=7,
            **_think_first(thinking_model)).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert "reasoning_content" not in (choice.message.model_extra or {})
    (call,) = choice.message.tool_calls
    _check_call(call, {"get_weather", "get_time"})
    assert "think" not in call.function.arguments
