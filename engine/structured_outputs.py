"""What a request's output must match (vLLM's StructuredOutputsParams): plain, validated data.

Exactly one constraint: ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any
JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (a Lark grammar in
llguidance's dialect, which may embed JSON schemas as ``%json {...}``). ``engine/grammar.py``
compiles it; this module only checks its shape, so it imports nothing heavy.

``reasoning_end`` (optional, beside the constraint): a thinking model's end-of-reasoning marker,
one token of the model's vocabulary (Qwen3's ``</think>``). The output is then free until that
token is generated and constrained after it (or from the start when the prompt already ends the
reasoning); the server sets it for chats under ``--reasoning-parser`` (docs/agents.md).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class GrammarKind(str, enum.Enum):
    """Which constraint the params set: each is the name of its field."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"

    def __str__(self) -> str:
        return self.value


KINDS = tuple(kind.value for kind in GrammarKind)  # the constraints' field names
OPTIONS = ("reasoning_end",)  # fields beside the one constraint


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One of the constraints (the others None / False), maybe with ``reasoning_end``. ``json``
    is kept as its JSON text, so the params stay immutable and hashable."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, (Mapping, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(self.json).__name__}")
            object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, "
                             f"got {self.json_object!r}")
        for name in ("regex", "grammar", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            choices = self.choice
            if (not isinstance(choices, (list, tuple)) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", tuple(choices))
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> GrammarKind:
        """Which constraint this is."""
        return next(kind for kind in GrammarKind if getattr(self, kind.value) not in (None, False))

    @classmethod
    def from_value(cls, value: object) -> StructuredOutputsParams | None:
        """None, the params themselves, or a mapping of their fields (``{"json": {...}}``)."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs must be a mapping of {', '.join(KINDS)}, "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS) - set(OPTIONS))
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; "
                             f"known: {', '.join(KINDS + OPTIONS)}")
        fields: dict[str, Any] = {k: v for k, v in value.items() if v is not None}
        return cls(**fields)
