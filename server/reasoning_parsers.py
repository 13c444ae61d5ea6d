"""Reasoning parsers: a thinking model's reasoning apart from its answer (``--reasoning-parser``).

``qwen3``: an output that starts with ``<think>`` is reasoning up to ``</think>`` and content
after it (all reasoning while the block is open: a thought cut off by max_tokens has no
content); an output that does not start with ``<think>`` is all content (Qwen3 with
``enable_thinking`` false, whose template writes the empty block into the prompt). The reasoning
goes out as ``reasoning`` (vLLM 0.32's field) and ``reasoning_content`` (the older one), in the
message and in stream deltas.

A chat's constraint (a forced tool call, structured outputs) starts after the reasoning when the
parser's end marker is one token of the model's vocabulary (``reasoning_end_token``): the engine
leaves the output free until it generates that token (docs/agents.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("kvengine.server")


class Qwen3ReasoningParser:
    """``<think>...</think>`` first, then the answer."""

    name = "qwen3"
    start, end = "<think>", "</think>"

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None when there is no thinking block, content) of ``text``; while
        streaming (not ``final``) without the tail that may still be part of a tag."""
        stripped = text.lstrip()
        if not stripped.startswith(self.start):
            if not final and self.start.startswith(stripped):
                return None, ""  # may still become "<think>": show nothing yet
            return None, text
        begin = len(text) - len(stripped) + len(self.start)
        close = text.find(self.end, begin)
        if close >= 0:
            return text[begin:close], text[close + len(self.end):]
        reasoning = text[begin:]
        if not final:
            for size in range(min(len(self.end) - 1, len(reasoning)), 0, -1):
                if self.end.startswith(reasoning[-size:]):
                    reasoning = reasoning[:-size]
                    break
        return reasoning, ""


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}


def reasoning_end_token(parser: Qwen3ReasoningParser | None,
                        encode: Callable[..., list[int]]) -> str | None:
    """The parser's end marker when ``encode`` makes it one token (Qwen3's ``</think>`` is one),
    else None. A model without that token does not think in the parser's format (the make-model
    checkpoints), so its constraints keep starting at the first token."""
    if parser is None:
        return None
    if len(encode(parser.end, add_special_tokens=False)) == 1:
        return parser.end
    logger.info("--reasoning-parser %s: %r is not one token of this model's vocabulary, so "
                "constrained chats are constrained from their first token", parser.name,
                parser.end)
    return None
