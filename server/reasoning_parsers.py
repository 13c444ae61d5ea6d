"""Reasoning parsers: a thinking model's reasoning apart from its answer (``--reasoning-parser``).

``qwen3``: an output that starts with ``<think>`` is reasoning up to ``</think>`` and content
after it (all reasoning while the block is open: a thought cut off by max_tokens has no
content); an output that does not start with ``<think>`` is all content (Qwen3 with
``enable_thinking`` false, whose template writes the empty block into the prompt). The reasoning
goes out as ``reasoning_content``, in the message and in stream deltas, as vLLM sends it.
"""

from __future__ import annotations


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
