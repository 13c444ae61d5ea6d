"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked, as vLLM
takes them.

``auto`` (the default when tools are given) needs ``--enable-auto-tool-choice`` and a
``--tool-call-parser``: the model decides, the parser reads its calls. ``required`` and a named
function (``{"type": "function", "function": {"name": ...}}``) are enforced by a grammar in the
parser's format (hermes when no parser is configured), so even a weak model returns a call whose
arguments match the function's schema. ``none``: the tools are still shown to the template (as
vLLM does), nothing is parsed. ``parallel_tool_calls`` false allows one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.chat_template import RESERVED_TEMPLATE_NAMES
from server.api_error import APIError
from server.tool_parsers import TOOL_PARSERS, ToolParser


@dataclass(frozen=True)
class ToolSettings:
    """The server's flags: ``--enable-auto-tool-choice``, ``--tool-call-parser NAME``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; choose from "
                             f"{', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True)
class ToolRequest:
    """What the serving path does with a request's tools."""

    parser: ToolParser | None  # reads the output's calls (None: tool_choice none)
    grammar: str | None  # the constraint of required / named choices
    named: bool  # a named function: the answer's finish_reason stays "stop", as OpenAI's


def tool_request(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
                 settings: ToolSettings) -> ToolRequest | None:
    """None without tools (``tool_choice`` must then be absent or none); APIError 400 for
    malformed tools or a choice the server cannot honour."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, f"tool_choice {_shown(tool_choice)} needs tools",
                           param="tool_choice")
        return None
    checked = checked_tools(tools)
    configured = (TOOL_PARSERS[settings.tool_call_parser]()
                  if settings.tool_call_parser else None)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolRequest(None, None, False)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or configured is None:
            raise APIError(400, '"auto" tool choice needs the server started with '
                           "--enable-auto-tool-choice and --tool-call-parser",
                           param="tool_choice")
        return ToolRequest(configured, None, False)
    parser = configured or TOOL_PARSERS["hermes"]()
    if choice == "required":
        return ToolRequest(parser, parser.grammar(checked, parallel is not False), False)
    name = _named(choice)
    chosen = [t for t in checked if t["function"]["name"] == name]
    if not chosen:
        raise APIError(400, f"tool_choice names function {name!r}, which is not among the "
                       "tools", param="tool_choice")
    return ToolRequest(parser, parser.grammar(chosen[:1], False), True)


def _named(choice: Any) -> str:
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        return choice["function"]["name"]
    raise APIError(400, f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                   f"\"function\": {{\"name\": ...}}}}, got {_shown(choice)}",
                   param="tool_choice")


def _checked_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                       param="tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise APIError(400, f"{where}.function needs a name", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema (an object)",
                       param="tools")
    return {**tool, "type": "function"}


def checked_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """A request's ``tools``, each a function tool with a name (APIError 400 otherwise)."""
    return [_checked_tool(tool, i) for i, tool in enumerate(tools)]


def template_inputs(messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None,
                    tools: list[Any] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What a chat's template renders, the same for /v1/chat/completions, /tokenize and the
    router's view of a prompt: the messages (``template_messages``) and the template's
    variables (``chat_template_kwargs``, APIError 400 if they set a name that is a request
    field of its own, and the request's ``tools``, checked: ``checked_tools``)."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = RESERVED_TEMPLATE_NAMES & kwargs.keys()
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)}: they are "
                       "request fields of their own", param="chat_template_kwargs")
    if tools:
        kwargs["tools"] = checked_tools(tools)
    return template_messages(messages), kwargs


def _shown(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: an assistant's tool-call arguments sent as JSON text
    (OpenAI's shape) become objects, as templates expect and transformers documents (Llama 3's
    would otherwise quote the text again)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_decoded(call) for call in calls]}
        out.append(message)
    return out


def _decoded(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
