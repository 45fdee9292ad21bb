"""`strict: true` as OpenAI means it: every object in the schema is closed.

JSON Schema leaves an object without `additionalProperties` open, and a grammar held to an open
object lets a small model write keys the schema never named until `max_tokens` runs out
(measured on the default model at temperature 0.8: `"launches_to_Europe_30_years_ago"` after
`"kind"`). OpenAI's strict mode requires `additionalProperties: false` on every object and
refuses a schema without it; Pydantic's `model_json_schema()` omits it. flare closes such objects
itself (and says so in the `flare` object's adjustments), and refuses, as OpenAI does, an object
that explicitly allows additional properties under strict: serving it would bring back the
unbounded answer strict exists to prevent.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is data (a literal), not a subschema: never rewritten.
_DATA = frozenset({"const", "enum", "default", "examples"})
# Keywords whose value maps names to subschemas: the map itself is not a schema.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class StrictError(ValueError):
    """A strict schema that allows additional properties; `pointer` locates the object."""

    def __init__(self, pointer: str) -> None:
        super().__init__(
            f"under strict, every object must be closed; the object at {pointer or '/'} sets additionalProperties "
            "to allow other keys (set it to false, or drop strict)"
        )
        self.pointer = pointer


def close_objects(schema: Any) -> tuple[Any, tuple[str, ...]]:
    """(the schema with `additionalProperties: false` added to every object schema that lacks
    it, the JSON pointers of the objects closed). Raises StrictError for an object whose
    `additionalProperties` (or `patternProperties`) allows other keys. The body parser bounds the
    nesting, so recursion is safe."""
    closed: list[str] = []
    return _close(schema, "", closed), tuple(closed)


def _close(schema: Any, pointer: str, closed: list[str]) -> Any:
    if isinstance(schema, list):
        return [_close(item, f"{pointer}/{i}", closed) for i, item in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    result: dict[str, Any] = {}
    for key, value in schema.items():
        where = f"{pointer}/{_escape(key)}"
        if key in _DATA:
            result[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            result[key] = {name: _close(sub, f"{where}/{_escape(name)}", closed) for name, sub in value.items()}
        else:
            result[key] = _close(value, where, closed)
    if _is_object(schema):
        if schema.get("patternProperties") or schema.get("additionalProperties", False) is not False:
            raise StrictError(pointer)
        if "additionalProperties" not in schema:
            result["additionalProperties"] = False
            closed.append(pointer or "/")
    return result


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if isinstance(kind, list):
        return "object" in kind
    return kind == "object" or (kind is None and "properties" in schema)


def _escape(name: str) -> str:
    """A name as an RFC 6901 pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")
