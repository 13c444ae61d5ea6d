"""Structured outputs in the engine: a random-weight model still writes what the grammar allows.

The tiny model's weights are random, so without the grammar masks its text is never JSON; with
them every output must parse and validate, greedy or sampled, alone or in a batch beside free
requests, which must come out exactly as they do without a constrained neighbour.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured_outputs import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "city": {"type": "string", "enum": ["Paris", "Zürich", "Tokyo"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "city", "age", "tags", "member"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about", "JSON please:", "The weather in Paris", "x"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm: LLM, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=120,
                            structured_outputs={"json": PERSON})
    for out in llm.generate(PROMPTS, params):
        assert out.finish_reason == "stop", out.text  # the grammar ended it, not max_tokens
        value = json.loads(out.text)
        jsonschema.validate(value, PERSON)
        assert set(value) == set(PERSON["required"])  # no extra keys


def test_choice_regex_and_json_object(llm: LLM) -> None:
    choice = llm.generate(PROMPTS, SamplingParams(
        temperature=1.0, seed=3, max_tokens=20,
        structured_outputs={"choice": ["yes", "no", "Zürich \"quoted\""]}))
    assert all(o.text in ("yes", "no", "Zürich \"quoted\"") for o in choice)
    regex = llm.generate(PROMPTS, SamplingParams(
        temperature=1.0, seed=3, max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}")))
    assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", o.text) for o in regex), [o.text for o in regex]
    obj = llm.generate(PROMPTS, SamplingParams(max_tokens=60,
                                               structured_outputs={"json_object": True}))
    for out in obj:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def test_a_grammar_that_breaks_while_decoding_ends_the_answer_as_an_error(llm: LLM) -> None:
    """A valid schema past one of llguidance's parser limits (an anyOf of 3,000 objects: a row
    of 3,000 items, the most is 2,000) compiles, then breaks at the answer's second token. That
    ended as "stop" with "{" for text, a success that was not JSON; now finish_reason "error",
    as vLLM's, beside a free request that is not touched."""
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                         "required": [f"k{i}"]} for i in range(3000)]}
    broken, free = llm.generate(PROMPTS[:2], [
        SamplingParams(max_tokens=32, structured_outputs={"json": schema}),
        SamplingParams(max_tokens=8, ignore_eos=True)])
    assert broken.finish_reason == "error", (broken.finish_reason, broken.text)
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    small = {**schema, "anyOf": schema["anyOf"][:100]}  # under the limit: a valid answer
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=32,
                                                   structured_outputs={"json": small}))[0]
    assert out.finish_reason in ("stop", "length"), out.finish_reason


def test_free_requests_are_unchanged_beside_constrained_ones(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS[:2], free)]
    engine = llm.engine
    engine.add_request("free-0", llm.tokenizer.encode(PROMPTS[0]), free)
    engine.add_request("json", llm.tokenizer.encode(PROMPTS[2]), SamplingParams(
        max_tokens=120, structured_outputs={"json": PERSON}))
    engine.add_request("free-1", llm.tokenizer.encode(PROMPTS[1]), free)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done["free-0"].token_ids, done["free-1"].token_ids] == alone
    jsonschema.validate(json.loads(done["json"].text), PERSON)


@pytest.mark.parametrize(("spec", "message"), [
    ({"json": {"type": "strin"}}, "structured_outputs.json: Invalid type: strin"),
    ({"json": {"type": "object", "properties": 5}}, "properties must be an object"),
    ({"regex": "(("}, "(?s)structured_outputs.regex: .*unclosed group"),
    ({"grammar": "start: nope"}, "(?s)structured_outputs.grammar: .*nope"),
])
def test_a_bad_constraint_is_refused_when_added(llm: LLM, spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("spec", [{}, {"json": {}, "regex": "a"}, {"choice": []},
                                  {"choice": ["a", 1]}, {"jsn": {}}, {"json": 5}])
def test_params_take_exactly_one_constraint(spec: dict) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=spec)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True])
def test_constrained_beside_free_requests_on_gpu(tiny_model_dir: Path, eager: bool) -> None:
    """One batch on the CUDA backend (decode steps replayed from graphs, or eager): every
    constrained output validates; the free rows beside them are not masked (they run to
    max_tokens in free text; that the kernel leaves unnamed rows bit-exact is
    tests/kernels/test_token_bitmask.py's)."""
    with LLM(str(tiny_model_dir), device="cuda", enforce_eager=eager) as gpu:
        engine = gpu.engine
        free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            ids = gpu.tokenizer.encode(prompt)
            engine.add_request(f"free-{i}", ids, free)
            engine.add_request(f"json-{i}", ids, SamplingParams(
                temperature=1.0, seed=i, max_tokens=160, structured_outputs={"json": PERSON}))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    for i in range(len(PROMPTS)):
        out = done[f"json-{i}"]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
        assert len(done[f"free-{i}"].token_ids) == 24
    assert not any(done[f"free-{i}"].text.startswith('{"name": ') for i in range(len(PROMPTS)))
