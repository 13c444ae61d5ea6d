"""The JSON our grammar lets a model write, pinned where it differs from vLLM's default backend
(xgrammar): the layout docs/agents.md states ("Where the JSON differs from vLLM's"). Fed
token by token to a real llguidance matcher over the tiny model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.grammar import GrammarCompiler
from engine.structured_outputs import StructuredOutputsParams
from engine.tokenizer import Tokenizer

OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                           "c": {"type": "string"}}, "required": ["a", "b"]}


@pytest.fixture(scope="module")
def accepts(tiny_model_dir: Path):
    tokenizer = Tokenizer(str(tiny_model_dir))
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(tokenizer, vocab)

    def check(text: str, schema: dict = OBJECT) -> bool:
        matcher = compiler.matcher(StructuredOutputsParams(json=json.dumps(schema)), [1])
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting

    return check


@pytest.mark.parametrize("text,allowed", [
    ('{"a": 1, "b": 2.5}', True),  # json.dumps' separators
    ('{"a":1,"b":2.5}', False),  # no other whitespace (xgrammar: any)
    ('{ "a": 1, "b": 2.5 }', False),
    ('{"a": 1,\n "b": 2}', False),
    ('{"b": 2.5, "a": 1}', False),  # the schema's key order
    ('{"a": 1, "b": 2, "c": "x"}', True),  # optional keys may be left out, not reordered
    ('{"c": "x", "a": 1, "b": 2}', False),
    ('{"a": 1, "b": 2, "d": 3}', False),  # closed: the schema says nothing of "d"
])
def test_layout_and_key_order(accepts, text: str, allowed: bool) -> None:
    assert accepts(text) is allowed


@pytest.mark.parametrize("text,allowed", [
    ('{"a": 1, "b": 1e5}', True), ('{"a": 1, "b": 1E+5}', True), ('{"a": 1, "b": -0}', True),
    ('{"a": 1, "b": 0.10}', True), ('{"a": 1, "b": 2.}', False),
    ('{"a": 01, "b": 2}', False), ('{"a": 1.0, "b": 2}', False), ('{"a": 1e2, "b": 2}', False),
])
def test_numbers(accepts, text: str, allowed: bool) -> None:
    assert accepts(text) is allowed


@pytest.mark.parametrize("text,allowed", [
    ('"é"', True),  # characters as themselves (json.dumps(ensure_ascii=False))
    ('"\\u00e9"', False), ('"\\ud83d\\ude00"', False),  # \u only for control characters
    ('"\\u0001"', True), ('"\\t"', True), ('"\\""', True), ('"\\\\"', True),
    ('"\\/"', False), ('"\t"', False),
])
def test_strings(accepts, text: str, allowed: bool) -> None:
    assert accepts(text, {"type": "string"}) is allowed


@pytest.mark.parametrize("text,allowed", [("[1, 2]", True), ("[1,2]", False), ("[]", True),
                                          ("[ 1, 2 ]", False)])
def test_arrays(accepts, text: str, allowed: bool) -> None:
    assert accepts(text, {"type": "array", "items": {"type": "integer"}}) is allowed
