"""A request's structured-output fields as the engine's ``structured_outputs`` mapping.

Spellings accepted, as OpenAI and vLLM clients send them (at most one per request):
``response_format`` ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
"schema", "strict"}}``; vLLM's ``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar" |
"json_object": ...}``; and vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``. The engine compiles what comes out (engine/grammar.py) and refuses a schema
it cannot compile with a ValueError, which the serving layer answers with a 400 naming the field
the client used (``Constraint.param``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.structured_outputs import KINDS
from server.api_error import APIError
from server.protocol import SamplingFields

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """The engine's ``structured_outputs`` mapping and the request field it came from."""

    spec: dict[str, Any]
    param: str


def constraint_of(body: SamplingFields) -> Constraint | None:
    """The request's output constraint, or None; APIError 400 for two of them or a malformed
    one."""
    found: list[Constraint] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append(Constraint(spec, "response_format"))
    if body.structured_outputs is not None:
        found.append(Constraint(_structured_outputs(body.structured_outputs),
                                "structured_outputs"))
    for field, kind in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append(Constraint({kind: value}, field))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise APIError(400, f"give one output constraint, not several: {names}",
                       param=found[1].param)
    return found[0] if found else None


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        holder = value.get("json_schema")
        if not isinstance(holder, dict):
            raise APIError(400, "response_format json_schema needs a `json_schema` object "
                           "({\"name\": ..., \"schema\": {...}})", param="response_format")
        schema = holder.get("schema", holder.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema "
                           "(an object)", param="response_format")
        return {"json": schema}
    raise APIError(400, f"response_format type {kind!r} is not supported; use text, "
                   "json_object or json_schema", param="response_format")


def _structured_outputs(value: dict[str, Any]) -> dict[str, Any]:
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise APIError(400, f"structured_outputs has unsupported fields {unknown}; kvengine "
                       f"takes one of {', '.join(KINDS)}", param="structured_outputs")
    if len(given) != 1:
        raise APIError(400, f"structured_outputs must set exactly one of "
                       f"{', '.join(KINDS)}", param="structured_outputs")
    return given
