"""POST /v1/responses (OpenAI's Responses API, vLLM 0.32 serves it; the OpenAI Agents SDK's
default) against a real server, through the stock OpenAI client, which parses every body and
event into its own types: text, a tool call and its result, a forced call, a JSON schema,
streaming, an answer cut by max_output_tokens, and what is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.kvengine import KvengineProcess

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
               "required": ["city"], "additionalProperties": False}}


@pytest.fixture()
def http(agent_server: KvengineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=agent_server.url, timeout=60) as plain:
        yield plain


def test_text_in_text_out(oai: openai.OpenAI) -> None:
    reply = oai.responses.create(model="tiny", input="Say hello.", max_output_tokens=12,
                                    instructions="Be brief.", temperature=0.0)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output[0].type == "message" and reply.output_text
    assert reply.output[-1].status == "incomplete"  # the item the limit cut, as OpenAI's
    assert reply.usage.output_tokens == 12 and reply.usage.input_tokens > 0
    assert reply.store is False


def test_a_forced_tool_call_and_its_result_in_the_next_turn(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=300, temperature=0.0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    second = oai.responses.create(model="tiny", max_output_tokens=8, temperature=0.0,
                                     tools=[WEATHER], input=[
                                         {"role": "user", "content": "Weather in Paris?"},
                                         calls[0].model_dump(exclude_none=True),
                                         {"type": "function_call_output",
                                          "call_id": calls[0].call_id, "output": "sunny"}])
    assert second.output and second.usage.input_tokens > first.usage.input_tokens


def test_a_json_schema_answer(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}},
              "required": ["n"], "additionalProperties": False}
    reply = oai.responses.create(model="tiny", input="A number.", max_output_tokens=400,
                                    text={"format": {"type": "json_schema", "name": "n",
                                                     "schema": schema, "strict": True}})
    assert reply.status == "completed", reply.output
    assert [item.status for item in reply.output] == ["completed"] * len(reply.output)
    assert json.loads(reply.output_text)["n"] in (1, 2, 3)


def test_a_stream_of_events(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model="tiny", input="Count.", max_output_tokens=10,
                                          temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text and done.text == text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10
    item_done = [e.item for e in events if e.type == "response.output_item.done"]
    assert item_done[-1].status == events[-1].response.output[-1].status == "incomplete"


def test_what_is_refused_says_why(http: httpx.Client) -> None:
    for body, needle in (({"previous_response_id": "resp_1"}, "stores no responses"),
                         ({"tools": [{"type": "web_search"}]}, "only function tools"),
                         ({"input": [{"type": "image_generation_call"}]}, "not supported"),
                         ({"frobnicate": 1}, "frobnicate"),
                         ({"text": {"format": "json_object"}}, "text.format must be an object"),
                         ({"text": {"format": ["x"]}}, "text.format must be an object"),
                         ({"text": {"format": 5}}, "text.format must be an object")):
        response = http.post("/v1/responses", json={"model": "tiny", "input": "hi", **body})
        assert response.status_code == 400, response.text
        assert needle in response.json()["error"]["message"]
    assert http.post("/v1/responses", json={"model": "other", "input": "hi"}).status_code == 404


def test_an_answer_cut_by_a_broken_grammar_is_an_error_not_a_success(
        http: httpx.Client) -> None:
    """A schema past a parser limit of llguidance's breaks the grammar at the answer's second
    token; the engine ends it with finish_reason "error", which the server answers as vLLM's
    does: a 500, or an error event in a stream (then [DONE]); a response fails likewise."""
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                         "required": [f"k{i}"]} for i in range(3000)]}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                       "schema": schema}}}
    reply = http.post("/v1/chat/completions", json=chat)
    assert reply.status_code == 500, reply.text
    assert reply.json()["error"]["code"] == "generation_failed"
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
        events = [line[len("data: "):] for line in stream.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "generation_failed"
    assert all(json.loads(e).get("choices", [{}])[0].get("finish_reason") != "error"
               for e in events[:-2])
    response = {"model": "tiny", "input": "hi", "max_output_tokens": 32,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    assert http.post("/v1/responses", json=response).status_code == 500
    with http.stream("POST", "/v1/responses", json={**response, "stream": True}) as stream:
        kinds = [line[len("event: "):] for line in stream.iter_lines()
                 if line.startswith("event: ")]
    assert kinds[-2:] == ["error", "response.failed"]


def test_a_refused_item_is_named(http: httpx.Client) -> None:
    """An input item the chat request cannot take: the 400 names where (it said only "1
    validation error for ChatCompletionRequest")."""
    reply = http.post("/v1/responses", json={"model": "tiny", "input": [
        {"type": "message", "content": "hi"}]})
    assert reply.status_code == 400, reply.text
    assert "messages" in reply.json()["error"]["message"], reply.text


@pytest.mark.parametrize("field", ["max_output_tokens", "temperature"])
def test_bad_numbers_are_400(http: httpx.Client, field: str) -> None:
    assert http.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                            field: "many"}).status_code == 400


def test_a_streamed_tool_call(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(
        model="tiny", input="Weather in Tokyo?", tools=[WEATHER], temperature=0.0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=300,
        stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed", kinds
    final = events[-1].response
    [call] = [item for item in final.output if item.type == "function_call"]
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert streamed == done.arguments == call.arguments
    assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == [i.type for i in final.output]
