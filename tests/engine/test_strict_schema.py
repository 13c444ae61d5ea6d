"""Objects are closed unless they say otherwise, as vLLM's default grammar backend (xgrammar,
strict mode) and OpenAI's strict function calling take them (issue 36)."""

from __future__ import annotations

from engine.strict_schema import strict_schema


def test_objects_that_say_nothing_are_closed_everywhere() -> None:
    schema = {"type": "object", "properties": {
        "city": {"type": "string"},
        "when": {"type": "object", "properties": {"day": {"type": "string"}}},
        "stops": {"type": "array", "items": {"properties": {"name": {"type": "string"}}}},
        "either": {"anyOf": [{"type": "object"}, {"type": "null"}]}},
        "$defs": {"pair": {"type": "object", "properties": {"a": {}}}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["when"]["additionalProperties"] is False
    assert props["stops"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["anyOf"][1]  # not an object
    assert out["$defs"]["pair"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_what_a_schema_says_about_extra_properties_is_kept() -> None:
    for said in ({"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                 {"patternProperties": {"^x-": {}}}, {"unevaluatedProperties": False}):
        out = strict_schema({"type": "object", "properties": {"a": {}}, **said})
        for key, value in said.items():
            assert out[key] == value
        if "additionalProperties" not in said:
            assert "additionalProperties" not in out


def test_all_of_branches_stay_open_and_non_objects_pass_through() -> None:
    schema = {"allOf": [{"type": "object", "properties": {"a": {}}},
                        {"type": "object", "properties": {"b": {}}}]}
    out = strict_schema(schema)
    assert all("additionalProperties" not in branch for branch in out["allOf"])
    assert strict_schema(True) is True and strict_schema({"type": "string"}) == \
        {"type": "string"}
