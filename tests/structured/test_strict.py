"""`strict: true` closes every object a schema leaves open, and refuses one that explicitly
allows other keys (structured/strict.py)."""

from __future__ import annotations

import pytest

from flare.structured.strict import StrictError, close_objects

PYDANTIC_STYLE = {
    "type": "object",
    "properties": {
        "kind": {"type": "string"},
        "where": {"$ref": "#/$defs/Place"},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "string"}}}},
        "note": {"anyOf": [{"type": "null"}, {"properties": {"x": {"type": "integer"}}}]},
    },
    "required": ["kind"],
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def test_every_open_object_is_closed_and_listed() -> None:
    closed, pointers = close_objects(PYDANTIC_STYLE)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Place"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["note"]["anyOf"][1]["additionalProperties"] is False
    assert sorted(pointers) == ["/", "/$defs/Place", "/properties/note/anyOf/1", "/properties/tags/items"]
    assert "additionalProperties" not in PYDANTIC_STYLE  # the client's schema is not changed


def test_a_closed_schema_is_left_as_it_is() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    assert close_objects(schema) == (schema, ())


def test_a_property_named_like_a_keyword_and_literal_values_are_not_schemas() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "string"}, "type": {"const": {"type": "object"}}},
        "additionalProperties": False,
    }
    closed, pointers = close_objects(schema)
    assert closed == schema and pointers == ()


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"type": "object", "additionalProperties": True}, ""),
        ({"type": "object", "properties": {"m": {"type": "object", "additionalProperties": {"type": "integer"}}}}, "/properties/m"),
        ({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, ""),
    ],
)
def test_an_object_that_allows_other_keys_is_refused(schema: dict, pointer: str) -> None:
    with pytest.raises(StrictError) as refused:
        close_objects(schema)
    assert refused.value.pointer == pointer
