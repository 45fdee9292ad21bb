"""The tool-call grammar on the tiny package's tokenizer: references in a function's parameters
resolve against those parameters (Pydantic's `$defs`), for each function of several, and strict
closes their objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flare.api.tools.grammar import tool_grammar
from flare.api.tools.parse import parse_tools
from flare.package.directory import open_package
from flare.structured import GrammarCompiler, GrammarState

SITE = {
    "$defs": {
        "Site": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"enum": ["FR", "JP"]}},
            "required": ["city", "country"],
        }
    },
    "type": "object",
    "properties": {"site": {"$ref": "#/$defs/Site"}},
    "required": ["site"],
}
# Another function with a definition of the same name: each resolves within its own parameters.
COUNT = {
    "$defs": {"Site": {"type": "integer", "minimum": 0, "maximum": 9}},
    "type": "object",
    "properties": {"n": {"$ref": "#/$defs/Site"}},
    "required": ["n"],
}


@pytest.fixture(scope="module")
def compiler(tiny_package: Path) -> GrammarCompiler:
    package = open_package(tiny_package)
    config = package.manifest.model
    return GrammarCompiler(
        package.tokenizer_json_path.read_text(), vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids
    )


def _state(compiler: GrammarCompiler, strict: bool) -> GrammarState:
    functions: list[dict[str, Any]] = [
        {"type": "function", "function": {"name": "record", "parameters": SITE, "strict": strict}},
        {"type": "function", "function": {"name": "count", "parameters": COUNT}},
    ]
    tools = parse_tools({"tools": functions, "tool_choice": "required"})
    assert tools is not None
    spec = tool_grammar(tools)
    assert spec is not None
    return GrammarState(compiler.compile(spec))


def _follows(state: GrammarState, text: str) -> bool:
    tokens = state.grammar.tokenizer.tokenize_str(text)
    return state.valid_prefix(tokens) == len(tokens)


@pytest.mark.parametrize("strict", [False, True])
def test_references_resolve_within_each_functions_parameters(compiler: GrammarCompiler, strict: bool) -> None:
    state = _state(compiler, strict)
    call = '<tool_call>{"name": "record", "arguments": {"site": {"city": "Paris", "country": "FR"}}}</tool_call>'
    assert _follows(state, call)
    assert not _follows(state, call.replace('"FR"', '"US"'))
    assert _follows(state, '<tool_call>{"name": "count", "arguments": {"n": 7}}</tool_call>')
    assert not _follows(state, '<tool_call>{"name": "count", "arguments": {"n": "Paris"}}</tool_call>')
    extra = call.replace('"FR"}', '"FR", "title": "x"}')
    assert _follows(state, extra) is not strict
