"""Agents against a real `kvengine serve --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3` on the random-weight tiny model, through the `openai` client.

The model's weights are random: every valid answer here is the grammar's doing (a mutant
without the mask fails these tests). Prompts with tools must be the ones transformers renders
from the bundled chat template, and an agent's next turn must reuse the cached prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from support.kvengine import KvengineProcess

from engine.make_model import CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Zürich", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 10}},
        "required": ["city", "days", "note"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "role": {"type": "string", "enum": ["admin", "user"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "role", "age"], "additionalProperties": False}
USER = [{"role": "system", "content": "You are a weather agent. " * 8},
        {"role": "user", "content": "What is the weather in Zürich?"}]


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_response_format(oai: openai.OpenAI, seed: int) -> None:
    answer = oai.chat.completions.create(
        model="tiny", messages=USER, max_tokens=200, temperature=1.0, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_guided_fields_on_both_endpoints(oai: openai.OpenAI) -> None:
    text = oai.completions.create(model="tiny", prompt="Pick:", max_tokens=10, temperature=1.0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert text.choices[0].text in ("left", "right")
    regex = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=20,
                                        extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(regex.choices[0].message.content) == 6
    schema = oai.completions.create(model="tiny", prompt="JSON:", max_tokens=200,
                                    extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(schema.choices[0].text), PERSON)
    obj = oai.completions.create(model="tiny", prompt="x", max_tokens=100, temperature=0.0,
                                 extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required(oai: openai.OpenAI, parallel: bool) -> None:
    answer = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=parallel,
                                         max_tokens=800, temperature=1.0, seed=4)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    if not parallel:
        assert len(choice.message.tool_calls) == 1


def test_tool_choice_named(oai: openai.OpenAI) -> None:
    answer = oai.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a named function
    _check_calls(choice.message.tool_calls, {"get_time"})
    assert len(choice.message.tool_calls) == 1 and not choice.message.content


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_a_schema_without_additional_properties_is_closed(oai: openai.OpenAI,
                                                          tool_choice: str) -> None:
    """As vLLM's default backend (xgrammar, strict) and OpenAI's strict mode take it: the call
    ends after the properties the schema names (it ran on to max_tokens with invented ones)."""
    open_clock = {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "tz": {"type": "string", "maxLength": 12}}, "required": ["tz"]}}}
    choice_arg = "required" if tool_choice == "required" else \
        {"type": "function", "function": {"name": "get_time"}}
    for seed in (1, 2, 3):
        answer = oai.chat.completions.create(model="tiny", messages=USER, tools=[open_clock],
                                             tool_choice=choice_arg, max_tokens=300,
                                             temperature=1.0, seed=seed)
        calls = answer.choices[0].message.tool_calls
        assert calls and answer.choices[0].finish_reason != "length", answer.choices[0]
        assert set(json.loads(calls[0].function.arguments)) == {"tz"}


def test_streamed_tool_calls_reassemble(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                         tool_choice="required", max_tokens=800, stream=True,
                                         temperature=1.0, seed=5)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id:
                entry["id"], entry["name"] = part.id, part.function.name
            entry["arguments"] += part.function.arguments or ""
    assert finish == "tool_calls" and calls
    num_pieces_seen = 0
    for entry in calls.values():
        assert entry["id"].startswith("call_")
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
        num_pieces_seen += 1
    assert num_pieces_seen == len(calls)


def test_tool_results_next_turn_reuses_the_cached_prefix(oai: openai.OpenAI,
                                                         tiny_model_dir: Path) -> None:
    """The agent loop: call, append the call and its result, call again. The second request's
    prompt is the first's plus the new turn, and everything before the new turn is cached."""
    from transformers import AutoTokenizer

    messages = list(USER)
    first = oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=200, temperature=1.0, seed=6)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    second = oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                         max_tokens=5)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    for answer, turn in ((first, USER), (second, messages)):  # the prompt transformers renders
        want = tokenizer.apply_chat_template(turn, tools=TOOLS, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
        assert answer.usage.prompt_tokens == len(want)
    block = 16
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // block * block  # the whole first prompt
    assert cached == second.usage.prompt_tokens_details.cached_tokens_by_tier["hbm"]
    assert second.usage.prompt_tokens - cached < 64  # the call, its result, the new header


def test_reasoning_content_in_message_and_stream(oai: openai.OpenAI) -> None:
    think = {"regex": "<think>\\n[a-z ]{1,20}\\n</think>\\n\\n[a-z]{1,10}"}
    answer = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=60, seed=1,
                                         extra_body={"structured_outputs": think})
    message = answer.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == reasoning  # vLLM 0.32's name for it
    assert reasoning.startswith("\n") and "<think>" not in message.content
    assert message.content.startswith("\n\n") and message.content.strip().isalpha()
    stream = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=60, seed=1,
                                         stream=True, extra_body={"structured_outputs": think})
    parts = {"reasoning": "", "reasoning_content": "", "content": ""}
    for chunk in stream:
        delta = chunk.choices[0].delta
        parts["content"] += delta.content or ""
        for name in ("reasoning", "reasoning_content"):
            parts[name] += (delta.model_extra or {}).get(name) or ""
    assert parts == {"reasoning": reasoning, "reasoning_content": reasoning,
                     "content": message.content}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format", "Invalid type: strin"),
    ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "needs a name"),
    ({"guided_json": PERSON, "guided_regex": "a"}, "guided_regex", "not several"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex",
     "cannot be combined"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_requests_get_400(agent_server: KvengineProcess, body: dict, param: str,
                              message: str) -> None:
    reply = httpx.post(agent_server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": USER, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_auto_tool_choice_needs_the_flags(tiny_model_dir: Path) -> None:
    with KvengineProcess("--model", str(tiny_model_dir), "--max-model-len", "1024",
                         "--num-kv-blocks", "128") as plain:
        body = {"messages": USER, "max_tokens": 200, "tools": TOOLS}
        reply = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 400 and "--enable-auto-tool-choice" in reply.text
        # One call, seeded: with parallel calls allowed the random model may start a second
        # call it has no tokens left to finish (finish_reason "length", no call claimed).
        forced = httpx.post(plain.url + "/v1/chat/completions", timeout=60,
                            json={**body, "tool_choice": "required", "seed": 3,
                                  "parallel_tool_calls": False}).json()
        assert forced["choices"][0]["finish_reason"] == "tool_calls", forced
        call = forced["choices"][0]["message"]["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
