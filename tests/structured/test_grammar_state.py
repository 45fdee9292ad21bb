"""A grammar state on the real tokenizer: masks of draft positions leave the state where the
accepted tokens put it (a rejected draft needs no undo), forced tokens, valid prefixes, and
the compiler's cache and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flare.package.directory import open_package
from flare.structured import CacheUse, GrammarCompiler, GrammarError, GrammarSpec, GrammarState, fill_masks

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tiny_package: Path) -> GrammarCompiler:
    package = open_package(tiny_package)
    config = package.manifest.model
    return GrammarCompiler(
        package.tokenizer_json_path.read_text(), vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids
    )


def _allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(mask_row[t // 32]) >> (t % 32)) & 1}


def test_draft_masks_leave_the_state_at_the_accepted_tokens(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA, "response_format"))
    state = GrammarState(grammar)
    drafts = grammar.tokenizer.tokenize_str('{"answer": "yes"')
    assert state.valid_prefix(drafts) == len(drafts)
    vocab = compiler.vocab_size
    masks = torch.full((len(drafts) + 1, -(-vocab // 32)), -1, dtype=torch.int32)
    fill_masks([(state, 0, drafts)], masks)
    # Only the first two drafts are accepted; the state goes on from there as if the rest
    # had never been proposed.
    assert state.accept(drafts[:2])
    alone = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32)
    fill_masks([(state, 0, ())], alone)
    assert _allowed(alone[0], vocab) == _allowed(masks[2], vocab)
    assert drafts[2] in _allowed(masks[2], vocab)


def test_forced_tokens_and_a_refused_draft(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA, "response_format"))
    state = GrammarState(grammar)
    assert state.accept(grammar.tokenizer.tokenize_str('{"'))
    # Properties come in the schema's order: the first key is forced whole.
    assert grammar.tokenizer.decode_str(state.forced_tokens()) == 'answer": "'

    bad = grammar.tokenizer.tokenize_str('answer": "maybe"')
    assert 0 < state.valid_prefix(bad) < len(bad)
    assert not state.finished


def test_the_cache_returns_one_grammar_per_schema_and_keeps_property_order(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "boolean"}}, "required": ["b", "a"]}
    first = compiler.compile(GrammarSpec.json_schema(schema, "p"))
    again = compiler.compile(GrammarSpec.json_schema(dict(schema), "other field"))
    # One prototype, and errors name the field of the request that asked.
    assert again.prototype is first.prototype and again.spec.param == "other field"
    state = GrammarState(first)
    assert state.accept(first.tokenizer.tokenize_str('{"'))
    assert first.tokenizer.decode_str(state.forced_tokens()).startswith('b"')


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema({"type": "strin"}, "response_format.json_schema.schema"),
        GrammarSpec("regex", "[a-", "structured_outputs.regex"),
        GrammarSpec("lark", "start: missing_rule", "structured_outputs.grammar"),
        GrammarSpec("regex", "a" * 300_000, "structured_outputs.regex"),
    ],
)
def test_an_invalid_constraint_is_a_grammar_error_naming_its_field(compiler: GrammarCompiler, spec: GrammarSpec) -> None:
    with pytest.raises(GrammarError) as refused:
        compiler.compile(spec)
    assert refused.value.param == spec.param and refused.value.message


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema({"$ref": "#"}, "response_format.json_schema.schema"),
        GrammarSpec.json_schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "structured_outputs.json"
        ),
        GrammarSpec("regex", r"[^\s\S]", "structured_outputs.regex"),
        GrammarSpec("lark", 'start: start "a"', "structured_outputs.grammar"),
    ],
)
def test_a_constraint_nothing_can_satisfy_is_refused_at_compile(compiler: GrammarCompiler, spec: GrammarSpec) -> None:
    with pytest.raises(GrammarError, match="nothing can satisfy this constraint") as refused:
        compiler.compile(spec)
    assert refused.value.param == spec.param
    assert not compiler.cached(spec)


def test_an_empty_answer_that_matches_is_not_unsatisfiable(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(GrammarSpec("regex", "(abc)?", "structured_outputs.regex"))
    assert not GrammarState(grammar).finished


def test_a_lexer_past_its_limits_is_refused_at_compile_not_in_a_round(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec.json_schema({"type": "string", "pattern": "^(X{1000}){1000}$"}, "response_format.json_schema.schema")
    with pytest.raises(GrammarError, match="too many expressions") as refused:
        compiler.compile(spec)
    assert "<state>" not in refused.value.message  # llguidance's parser dump is not for the client
    assert not compiler.cached(spec)


def test_the_cache_is_bounded_by_bytes_and_clear_empties_it(tiny_package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An entry's bytes are what the process's resident memory grew by during its compile, or its
    # source's length if more: here the resident memory holds still, so each entry counts its
    # source's 1,506 bytes. Measured, a page the allocator happened to take during a compile made
    # an entry count over the whole bound, and it was not kept.
    monkeypatch.setattr("flare.structured.compiler.resident_bytes", lambda: 0)
    package = open_package(tiny_package)
    config = package.manifest.model
    small = GrammarCompiler(
        package.tokenizer_json_path.read_text(), vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids,
        cache_bytes=4_000,
    )
    specs = [GrammarSpec("regex", f"{letter}{{1,3}}" + "x" * 1500, "structured_outputs.regex") for letter in "abcd"]
    for spec in specs:
        small.compile(spec)
        assert small.use().bytes <= 4_000
    # Two of the four fit; the oldest go.
    assert small.use() == CacheUse(2, 2 * 1506)
    assert not small.cached(specs[0]) and not small.cached(specs[1])
    assert small.cached(specs[2]) and small.cached(specs[3])
    held = small.use()
    assert small.clear() == held
    assert small.use() == CacheUse(0, 0)
