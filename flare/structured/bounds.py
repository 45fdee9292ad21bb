"""What a constraint may be before it reaches llguidance: bounds on its shape.

llguidance's converters (JSON schema to grammar, Lark to grammar) recurse once per chained
reference. A chain long enough overflows the compiling thread's stack, which kills the whole
process (measured on llguidance 1.9.1 with an 8 MiB stack: 3,000 chained Lark rules, 3,000 chained
`$ref`s or 1,000 chained object `$ref`s crash it; 2,000, 2,000 and 500 compile). Nesting written
inline is already refused by llguidance's own parser (a recursion limit of 128), so the open
paths are chains, which these bounds close with a wide margin; the compile also runs on a thread
with a much larger stack (compiler.py), so the bounds are not the only guard.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_SOURCE_CHARS = 200_000
"""The largest schema, pattern or grammar text accepted (the body limit bounds it too)."""

MAX_SCHEMA_DEPTH = 128
"""The deepest path through a JSON schema, each `$ref` followed counting as one level: about a
twentieth of the shallowest crash on an 8 MiB stack (1,000 chained object `$ref`s, 2,877 levels
by this count), and deeper than any model a Pydantic user writes by hand."""

MAX_LARK_RULES = 1_000
"""The most rules and terminals a Lark grammar defines: half of the 2,000 chained rules that
still compile on an 8 MiB stack."""

# A Lark definition: a rule or terminal name (with Lark's ?/! prefixes and .priority) and a colon
# at the start of a line; alternatives continue with "|" and are not definitions.
_LARK_DEFINITION = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?\d+)?\s*:", re.MULTILINE)


class BoundError(ValueError):
    """A constraint beyond a bound (the message names the bound; the caller names the field)."""


def check_source_size(source: str) -> None:
    if len(source) > MAX_SOURCE_CHARS:
        raise BoundError(f"is {len(source)} characters; at most {MAX_SOURCE_CHARS} are accepted")


def check_lark(source: str) -> None:
    rules = len(_LARK_DEFINITION.findall(source))
    if rules > MAX_LARK_RULES:
        raise BoundError(f"defines {rules} rules and terminals; at most {MAX_LARK_RULES} are accepted")


def check_schema(schema: Any) -> None:
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise BoundError(
            f"nests {depth} levels deep (each $ref followed counts as one); at most {MAX_SCHEMA_DEPTH} are accepted"
        )


def schema_depth(schema: Any) -> int:
    """The deepest path through `schema`, following its local `$ref`s (#/...), where a recursive
    reference (one already on the path) ends the path: that is a recursive type, which
    llguidance expands lazily, not a chain. Memoized per referenced location, so shared
    definitions cost once; iterative, so a hostile schema cannot overflow this walk either."""
    return _depth(schema, schema, 0, {}, {"#"})  # the root is on every path


def _depth(root: Any, node: Any, base: int, memo: dict[str, int], on_path: set[str]) -> int:
    """The depth below `node` (itself 1), which sits `base` levels deep. The inline structure is
    walked with an explicit stack; each $ref starts a memoized sub-walk, and a walk past
    MAX_SCHEMA_DEPTH stops following references (the bound is already passed, so its count
    needs no precision), which keeps this function's own recursion under the bound."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(node, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in on_path:
                if base + depth > MAX_SCHEMA_DEPTH:
                    deepest = max(deepest, depth + 1)
                elif ref in memo:
                    deepest = max(deepest, depth + memo[ref])
                else:
                    target = _resolve(root, ref)
                    if target is not None:
                        on_path.add(ref)
                        below = _depth(root, target, base + depth, memo, on_path)
                        on_path.discard(ref)
                        memo[ref] = below
                        deepest = max(deepest, depth + below)
            stack.extend(
                (child, depth + 1) for key, child in value.items() if key != "$ref" and isinstance(child, (dict, list))
            )
        elif isinstance(value, list):
            stack.extend((child, depth) for child in value if isinstance(child, (dict, list)))
    return deepest


def _resolve(root: Any, ref: str) -> Any:
    """The value a local JSON pointer reference (#, #/a/b, RFC 6901 escapes) names, or None."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check(kind: str, source: str) -> None:
    """Every bound for a constraint of `kind` written as `source` (GrammarSpec's fields)."""
    check_source_size(source)
    if kind == "json_schema":
        check_schema(json.loads(source))
    elif kind == "lark":
        check_lark(source)
