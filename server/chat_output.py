"""ChatOutput: one chat choice's text as an assistant message or as stream deltas.

The text goes through the reasoning parser first (``reasoning_content``), then the tool-call
parser over what is left (``tool_calls``; the text before the first call stays ``content``).
Streaming sends each part as it becomes certain, in OpenAI's delta shapes: ``{"content": ...}``,
``{"reasoning_content": ...}``, and per call first ``{"tool_calls": [{"index", "id", "type":
"function", "function": {"name", "arguments": ""}}]}`` then ``{"tool_calls": [{"index",
"function": {"arguments": piece}}]}``; the pieces of a call's arguments concatenate to the
arguments the whole message would carry.
"""

from __future__ import annotations

from typing import Any

from server.reasoning_parsers import Qwen3ReasoningParser
from server.tool_parsers import ToolParser, new_call_id


class ChatOutput:
    """Parses one choice; ``tools`` None: no tool-call parsing (``tool_choice`` none, or no
    parser), ``reasoning`` None: no reasoning split."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._num_reasoning_sent = 0
        self._num_content_sent = 0
        self._call_ids: list[str] = []
        self._names_sent: list[bool] = []
        self._arguments_sent: list[int] = []
        self.num_tool_calls = 0  # calls in the message / stream so far

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, final)

    # ---- a whole message -----------------------------------------------------------------
    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a finished choice."""
        reasoning, content = self._split(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:  # vLLM 0.32's field, and the older one clients still read
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.tools is not None:
            rest, calls = self.tools.extract(content)
            if calls:
                message["content"] = rest
                message["tool_calls"] = [
                    {"id": new_call_id(), "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                self.num_tool_calls = len(calls)
        return message

    # ---- a stream ------------------------------------------------------------------------
    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas that ``text`` (everything generated so far) adds to what was sent."""
        out: list[dict[str, Any]] = []
        reasoning, content = self._split(text, final)
        if reasoning is not None and len(reasoning) > self._num_reasoning_sent:
            piece = reasoning[self._num_reasoning_sent:]
            out.append({"reasoning": piece, "reasoning_content": piece})
            self._num_reasoning_sent = len(reasoning)
        shown = len(content) if self.tools is None else self.tools.content_end(content, final)
        malformed = (self.tools is not None and final
                     and not self.tools.extract(content)[1])
        if malformed:  # no well-formed call after all: the rest is content (a call may have
            shown = len(content)  # been announced already: a stream cannot take it back)
        if shown > self._num_content_sent:
            out.append({"content": content[self._num_content_sent:shown]})
            self._num_content_sent = shown
        if self.tools is not None and not malformed:
            out.extend(self._tool_deltas(content, final))
        return out

    def _tool_deltas(self, content: str, final: bool) -> list[dict[str, Any]]:
        assert self.tools is not None
        out = []
        final_calls = self.tools.extract(content)[1] if final else []
        for index, call in enumerate(self.tools.call_texts(content)):
            if index == len(self._call_ids):
                self._call_ids.append(new_call_id())
                self._names_sent.append(False)
                self._arguments_sent.append(0)
            whole = final_calls[index] if index < len(final_calls) else None
            name = whole.name if whole is not None else self.tools.call_name(call.text)
            if name is None:
                continue
            if not self._names_sent[index]:
                self._names_sent[index] = True
                self.num_tool_calls = index + 1
                out.append({"tool_calls": [{
                    "index": index, "id": self._call_ids[index], "type": "function",
                    "function": {"name": name, "arguments": ""}}]})
            arguments = (whole.arguments if whole is not None
                         else self.tools.raw_arguments(call.text) or "")
            sent = self._arguments_sent[index]
            if len(arguments) > sent:  # streamed pieces are prefixes of the same raw text
                out.append({"tool_calls": [{"index": index,
                                            "function": {"arguments": arguments[sent:]}}]})
                self._arguments_sent[index] = len(arguments)
        return out


class ChatShape:
    """The chat outputs of one HTTP request (a ``ChatOutput`` per choice) and how its choices
    finish: ``tool_calls`` when calls came back, except for a named function, whose answer ends
    with ``stop`` as OpenAI's does."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None,
                 named: bool) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._named = named
        self._outputs: dict[str, ChatOutput] = {}

    def _output(self, request_id: str) -> ChatOutput:
        if request_id not in self._outputs:
            self._outputs[request_id] = ChatOutput(self._reasoning, self._tools)
        return self._outputs[request_id]

    def _reason(self, output: ChatOutput, finish_reason: str | None) -> str | None:
        if output.num_tool_calls and finish_reason == "stop" and not self._named:
            return "tool_calls"
        return finish_reason

    def message(self, request_id: str, text: str,
                finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(assistant message, finish reason) of a finished choice."""
        output = self._output(request_id)
        message = output.message(text)
        return message, self._reason(output, finish_reason)

    def chunks(self, request_id: str, text: str, finished: bool,
               finish_reason: str | None) -> list[tuple[dict[str, Any], str | None]]:
        """(delta, finish reason or None) of each chunk the choice's text adds; the finish
        reason rides on the last chunk of a finished choice."""
        output = self._output(request_id)
        if not finished:  # an incomplete UTF-8 character at the end waits for its next token
            text = text.rstrip("\ufffd")
        deltas = output.deltas(text, finished)
        if not finished:
            return [(delta, None) for delta in deltas]
        reason = self._reason(output, finish_reason)
        if not deltas:
            return [({}, reason)]
        return [(delta, None) for delta in deltas[:-1]] + [(deltas[-1], reason)]
