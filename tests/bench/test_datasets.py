"""The shipped prompt sets and JSONL files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from flare.bench.datasets import SHIPPED, DatasetError, load_dataset
from flare.preparation.source import ModelSource


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_set_has_distinct_non_empty_conversations(name: str) -> None:
    conversations = load_dataset(name)
    assert len(conversations) >= 8
    assert all(c.turns and all(t.strip() for t in c.turns) for c in conversations)
    assert len({c.turns for c in conversations}) == len(conversations)


def test_shipped_sets_are_the_same_in_every_load() -> None:
    assert load_dataset("long-prompt") == load_dataset("long-prompt")


def test_long_prompts_span_one_to_four_thousand_tokens(smollm2_source: ModelSource) -> None:
    tokenizer = Tokenizer.from_str(smollm2_source.tokenizer_json)
    sizes = [len(tokenizer.encode(c.turns[0]).ids) for c in load_dataset("long-prompt")]
    assert 1000 <= min(sizes) and max(sizes) <= 4096, sizes


def test_multi_turn_conversations_have_several_turns() -> None:
    assert all(len(c.turns) >= 3 for c in load_dataset("multi-turn"))


def test_copy_prompts_carry_the_text_to_copy() -> None:
    assert all("\n\n" in c.turns[0] and len(c.turns[0]) > 200 for c in load_dataset("copy"))


def test_jsonl_file_holds_prompts_messages_and_turns(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl"
    lines = [
        {"prompt": "Hello there", "max_tokens": 7},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"turns": ["one", "two"], "system": "You count."},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    first, second, third = load_dataset(str(path))
    assert first.turns == ("Hello there",) and first.max_tokens == 7 and first.history == ()
    assert second.turns == ("Hi",) and second.history == ({"role": "system", "content": "Be brief."},)
    assert third.turns == ("one", "two") and third.history == ({"role": "system", "content": "You count."},)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": ""}', "'prompt' must be a non-empty string"),
        ('{"prompt": "a", "turns": ["b"]}', "exactly one of"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}', "the last message"),
        ('{"messages": [{"role": "robot", "content": "a"}]}', "role"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be a positive integer"),
        ('{"turns": []}', "non-empty list"),
    ],
)
def test_a_bad_jsonl_line_is_refused_with_its_line_number(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=message) as error:
        load_dataset(str(path))
    assert f"{path}:2" in str(error.value)


def test_an_unknown_dataset_name_lists_the_shipped_ones() -> None:
    with pytest.raises(DatasetError, match="neither one of chat, copy, long-prompt, multi-turn"):
        load_dataset("no-such-set")
