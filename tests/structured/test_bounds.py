"""The bounds a constraint meets before llguidance sees it (structured/bounds.py): exactly at a
bound is accepted, one past it is refused with a message naming the bound."""

from __future__ import annotations

from typing import Any

import pytest

from flare.structured.bounds import MAX_LARK_RULES, MAX_SCHEMA_DEPTH, BoundError, check, schema_depth


def chained_refs(n: int) -> dict[str, Any]:
    """{"$defs": {"d0": {"$ref": "#/$defs/d1"}, ..., "dn": {"type": "string"}}, "$ref": "#/$defs/d0"}"""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def chained_rules(n: int) -> str:
    """start: r0 / r0: r1 "a" / ... / rn: "z" (n + 2 definitions)."""
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "a"' for i in range(n)), f'r{n}: "z"'])


def test_a_chain_of_refs_counts_each_ref_as_a_level() -> None:
    # The root, its $defs map and each definition along the chain.
    assert schema_depth(chained_refs(10)) == 13
    assert schema_depth(chained_refs(MAX_SCHEMA_DEPTH - 3)) == MAX_SCHEMA_DEPTH


def test_recursive_types_and_shared_definitions_are_not_chains() -> None:
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    assert schema_depth(tree) == 4
    shared = {"$defs": {"p": {"type": "string"}}, "properties": {f"k{i}": {"$ref": "#/$defs/p"} for i in range(500)}}
    assert schema_depth(shared) == 4


def test_schemas_at_the_depth_bound_pass_and_past_it_are_refused() -> None:
    import json

    check("json_schema", json.dumps(chained_refs(MAX_SCHEMA_DEPTH - 3)))
    with pytest.raises(BoundError, match=f"at most {MAX_SCHEMA_DEPTH}"):
        check("json_schema", json.dumps(chained_refs(MAX_SCHEMA_DEPTH - 2)))
    # The reported crash: 3,000 chained $refs, counted without walking all of them.
    with pytest.raises(BoundError, match="nests"):
        check("json_schema", json.dumps(chained_refs(3000)))


def test_lark_grammars_at_the_rule_bound_pass_and_past_it_are_refused() -> None:
    check("lark", chained_rules(MAX_LARK_RULES - 2))
    with pytest.raises(BoundError, match=f"defines {MAX_LARK_RULES + 1} rules and terminals; at most {MAX_LARK_RULES}"):
        check("lark", chained_rules(MAX_LARK_RULES - 1))
