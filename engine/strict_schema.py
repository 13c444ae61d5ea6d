"""strict_schema: a JSON schema whose objects take no properties they do not name.

vLLM's default grammar backend (xgrammar, strict mode) and OpenAI's strict function calling
treat an object schema that does not say ``additionalProperties`` as closed. llguidance follows
JSON Schema (open objects), so a tool whose parameters name no ``additionalProperties``, called
with ``tool_choice`` named or ``required``, got its required properties and then invented ones
until ``max_tokens``: no call came back. Here every object schema that says nothing about extra
properties (no ``additionalProperties``, ``unevaluatedProperties`` or ``patternProperties``)
gets ``additionalProperties: false``, except the branches of an ``allOf`` (closing each branch
would refuse the properties the others name). A schema that allows extra properties explicitly
keeps them.
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
# Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "additionalProperties", "unevaluatedProperties", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` with its objects closed as described above (non-dict parts, and
    booleans, as they are)."""
    return _close(schema, closable=True)


def _close(node: Any, closable: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], True)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(item, True) for item in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(item, False) for item in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(item, True) for name, item in out[key].items()}
    is_object = out.get("type") == "object" or (
        isinstance(out.get("type"), list) and "object" in out["type"]) or "properties" in out
    if closable and is_object and not any(key in out for key in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
