"""ChatTemplate: a model's Jinja chat template, rendered as transformers' apply_chat_template does.

Chat templates are written against transformers' environment, not plain Jinja: a sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``,
``{% continue %}``), a ``tojson`` that keeps non-ASCII text and takes ``indent``, ``separators``
and ``sort_keys``, the globals ``raise_exception`` and ``strftime_now``, and a
``{% generation %}`` block (it marks assistant text for training masks; rendering keeps its body).
Any difference changes the prompt a model sees, so this module follows that environment and the
tests compare its output with transformers' own on the public templates of Qwen3, Qwen2.5 and
Llama 3.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers fills `reasoning_content` (what templates read) from these older names too.
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}")


class _Dict:
    """``dict(...)`` in templates, without handing the ``dict`` type itself to the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (< > & ') and ignores these options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed Jinja environment chat templates are written for."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _with_reasoning_aliases(message: Mapping[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_NAMES if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# The template variables ``ChatTemplate.render`` fills from its own parameters: its ``kwargs`` may
# not name them (the server answers a request whose chat_template_kwargs do with a 400).
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplate:
    """One compiled template; ``render`` is safe from several threads (Jinja templates are)."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any] | None = None) -> None:
        """``special_tokens``: what transformers passes as ``special_tokens_map`` (``bos_token``,
        ``eos_token``, ...; only the tokens the model has)."""
        self.source = source
        self._special_tokens = dict(special_tokens or {})
        self._template = make_environment().from_string(source)  # TemplateSyntaxError if bad

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text. ``kwargs`` (e.g. Qwen3's ``enable_thinking``) become template
        variables and override the special tokens, as in transformers; jinja2's TemplateError
        (including ``raise_exception``) passes to the caller."""
        chat = [_with_reasoning_aliases(m) for m in messages]
        variables = {**self._special_tokens, **kwargs}
        return self._template.render(messages=chat, tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt, **variables)
