"""What a request constrains its answer to, before compilation (kept free of llguidance)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "regex", "lark", "choice"]


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: `kind` and its `source` (a JSON schema as compact JSON text, a regular
    expression, a Lark grammar, or a JSON list of the allowed strings). `param` names the request
    field it came from, for errors. `closed_objects`: the JSON pointers of the objects a strict
    schema had open and flare closed (strict.py), reported to the client."""

    kind: GrammarKind
    source: str
    param: str
    closed_objects: tuple[str, ...] = ()

    @classmethod
    def json_schema(cls, schema: Any, param: str, closed_objects: tuple[str, ...] = ()) -> GrammarSpec:
        # Compact text, keys in the client's order: an object's properties are generated in the
        # order the schema lists them, as OpenAI does, so the order is part of the schema.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param, closed_objects)

    def cache_key(self, scope: bytes = b"") -> tuple[bytes, str, str]:
        """The compiled grammar's key in the cache of `scope` (whose cached grammars a request
        may find: the prefix cache's scope, api/cache_scope.py)."""
        return (scope, self.kind, self.source)
