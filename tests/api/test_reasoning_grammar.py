"""A JSON schema's grammar holds the answer after the reasoning, never the reasoning itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from flare.api.reasoning import after_reasoning
from flare.package.directory import open_package
from flare.package.reasoning_formats import THINK
from flare.structured import GrammarCompiler, GrammarSpec, GrammarState

SCHEMA = GrammarSpec.json_schema(
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    "response_format",
)


@pytest.fixture(scope="module")
def compiler(tiny_package: Path) -> GrammarCompiler:
    package = open_package(tiny_package)
    config = package.manifest.model
    return GrammarCompiler(
        package.tokenizer_json_path.read_text(), vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids
    )


def _whole(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    state = GrammarState(compiler.compile(spec))
    tokens = state.grammar.tokenizer.tokenize_str(text)
    if state.valid_prefix(tokens) != len(tokens):
        return False
    state.accept(tokens)
    return state.matcher.is_accepting()  # type: ignore[attr-defined]


def test_the_reasoning_is_free_and_the_answer_after_it_follows_the_schema(compiler: GrammarCompiler) -> None:
    spec = after_reasoning(SCHEMA, THINK, inside=False)
    assert spec.param == "response_format"
    assert _whole(compiler, spec, '<think>\nAnything {at all} </thin, "ok": 3\n</think>\n\n{"ok": true}')
    assert _whole(compiler, spec, '{"ok": false}')
    assert not _whole(compiler, spec, "<think>hm</think>\n\nnot JSON")
    assert not _whole(compiler, spec, '<think>hm</think>{"ok": true}<think>again</think>')


def test_a_prompt_that_opened_the_reasoning_needs_only_its_end(compiler: GrammarCompiler) -> None:
    spec = after_reasoning(SCHEMA, THINK, inside=True)
    assert _whole(compiler, spec, 'Let me see.</think>\n\n{"ok": true}')
    assert not _whole(compiler, spec, '{"ok": true}')
