"""Tool-call parsers: a model's own tool-call format out of its text, whole or as it streams.

Chosen by vLLM's names (``--tool-call-parser``): ``hermes`` (Qwen2.5/Qwen3, Hermes:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call) and
``llama3_json`` (Llama 3.1-3.3: ``{"name": ..., "parameters": {...}}``, calls separated by
``;``). A parser also writes the grammar that forces its own format (``tool_choice`` required or
a named function): the output stays in the model's format, so the chat template renders the call
back as the same text in the next turn and its prefix is served from the cache.

A text whose calls do not parse as JSON objects with a ``name`` and arguments is left as content
with no tool calls. Arguments are the model's own JSON text of the arguments object (what a
stream sends piece by piece), so streamed and whole answers carry the same string.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
# Calls one forced answer may hold (tool_choice required with parallel calls): bounds what a
# weak model that keeps calling can spend.
MAX_PARALLEL_CALLS = 16


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallText:
    """The text of one call object in the output; ``closed`` once its end was seen."""

    text: str
    closed: bool


def new_call_id() -> str:
    """An id for a tool call, in OpenAI's shape (``call_`` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``start`` (whitespace skipped), or None
    while it is incomplete."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i >= len(text):
        return None
    depth, in_string, escaped = 0, False, False
    if text[i] not in "{[\"":
        match = re.compile(r"[^,}\]\s]*").match(text, i)
        end = match.end()
        return end if end < len(text) else None
    for j in range(i, len(text)):
        char = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


class ToolParser(ABC):
    """One model family's tool-call format. Stateless: streams keep their state elsewhere."""

    name: str
    arguments_keys: tuple[str, ...]  # the keys that may hold the arguments, first is written

    @abstractmethod
    def content_end(self, text: str, final: bool) -> int:
        """How much of ``text`` is content that can be shown now (before any call; while
        streaming, not a tail that may still become a call's start)."""

    @abstractmethod
    def call_texts(self, text: str) -> list[CallText]:
        """The call objects in ``text`` so far, in order."""

    @abstractmethod
    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance) forcing one call (or several, ``parallel``) of
        ``tools`` in this format; the arguments follow each function's JSON schema."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; malformed calls: (text, [])."""
        calls = []
        for call in self.call_texts(text):
            parsed = self.parse_call(call.text)
            if parsed is None:
                return text, []
            calls.append(parsed)
        if not calls:
            return text, []
        content = text[: self.content_end(text, final=True)]
        return (content if content.strip() else None), calls

    def parse_call(self, text: str) -> ToolCall | None:
        """A call object's name and raw arguments text, or None unless it is a JSON object
        with a string name and an object of arguments."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        key = next((k for k in self.arguments_keys if k in value), None)
        if key is None or not isinstance(value[key], dict):
            return None
        raw = self.raw_arguments(text)
        if raw is None or json.loads(raw) != value[key]:
            raw = json.dumps(value[key], ensure_ascii=False)
        return ToolCall(value["name"], raw)

    def raw_arguments(self, text: str) -> str | None:
        """The arguments' own text in a (maybe partial) call object: up to its end when
        complete, else all there is so far; None before its key."""
        keys = "|".join(re.escape(k) for k in self.arguments_keys)
        match = re.search(rf'"(?:{keys})"\s*:\s*', text)
        if match is None:
            return None
        end = json_value_end(text, match.end())
        return text[match.end():] if end is None else text[match.end():end]

    @staticmethod
    def call_name(text: str) -> str | None:
        """The call's function name once its string is complete."""
        match = _NAME.search(text)
        return None if match is None else json.loads(f'"{match.group(1)}"')

    def _call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        from engine.strict_schema import strict_schema  # objects closed, as vLLM's default

        function = tool["function"]
        parameters = strict_schema(function.get("parameters") or {"type": "object"})
        return {"type": "object", "properties": {
            "name": {"const": function["name"]}, self.arguments_keys[0]: parameters},
            "required": ["name", self.arguments_keys[0]], "additionalProperties": False}

    def _payload_rule(self, tools: list[dict[str, Any]]) -> str:
        from engine.grammar import JSON_OPTIONS  # JSON as the engine writes it (json.dumps')

        schemas = [self._call_schema(t) for t in tools]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema = {**schema, "x-guidance": JSON_OPTIONS}
        return "payload: %json " + json.dumps(schema, ensure_ascii=False)


def _held_back(text: str, marker: str) -> int:
    """Length of ``text``'s longest tail that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{json}\\n</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes 2/3)."""

    name = "hermes"
    arguments_keys = ("arguments",)
    start, end = "<tool_call>", "</tool_call>"

    def content_end(self, text: str, final: bool) -> int:
        found = text.find(self.start)
        if found >= 0:
            return found
        return len(text) if final else len(text) - _held_back(text, self.start)

    def call_texts(self, text: str) -> list[CallText]:
        out = []
        pos = text.find(self.start)
        while pos >= 0:
            body_start = pos + len(self.start)
            close = text.find(self.end, body_start)
            if close < 0:
                out.append(CallText(text[body_start:].strip(), False))
                break
            out.append(CallText(text[body_start:close].strip(), True))
            pos = text.find(self.start, close + len(self.end))
        return out

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        calls = f'call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "call"
        return (f"start: {calls}\n"
                'call: "<tool_call>\\n" payload "\\n</tool_call>"\n'
                f"{self._payload_rule(tools)}\n")


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3's JSON tool calls: the whole output is ``{"name": ..., "parameters":
    {...}}`` objects separated by ``;`` (``<|python_tag|>`` first is allowed)."""

    name = "llama3_json"
    arguments_keys = ("parameters", "arguments")
    python_tag = "<|python_tag|>"

    def _body_start(self, text: str) -> int | None:
        """Where the calls begin, None when the text is not calls (or not yet known)."""
        i = len(text) - len(text.lstrip())
        if text.startswith(self.python_tag, i):
            i += len(self.python_tag)
            i += len(text[i:]) - len(text[i:].lstrip())
        return i if text[i:i + 1] == "{" else None

    def content_end(self, text: str, final: bool) -> int:
        if self._body_start(text) is not None:
            return 0
        stripped = text.lstrip()
        if not final and (not stripped or self.python_tag.startswith(stripped)):
            return 0  # nothing but what may still turn into calls
        return len(text)

    def call_texts(self, text: str) -> list[CallText]:
        pos = self._body_start(text)
        out: list[CallText] = []
        while pos is not None and pos < len(text):
            end = json_value_end(text, pos)
            if end is None:
                out.append(CallText(text[pos:].strip(), False))
                break
            out.append(CallText(text[pos:end].strip(), True))
            rest = re.compile(r"\s*;?\s*").match(text, end)
            pos = rest.end() if text[rest.end():rest.end() + 1] == "{" else None
        return out

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        calls = (f'payload ("; " payload){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel
                 else "payload")
        return f"start: {calls}\n{self._payload_rule(tools)}\n"


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
