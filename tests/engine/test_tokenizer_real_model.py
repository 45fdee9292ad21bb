"""The default package's tokenizer and chat template, against transformers on the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.engine.test_incremental_detokenizer import SAMPLES

from flare.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from flare.package.directory import open_package

pytestmark = pytest.mark.real_model

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Réponds en français. 日本語も OK 👍"},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "  spaces  and\nnewlines\t"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(default_package: Path) -> Tokenizer:
    return Tokenizer.from_package(open_package(default_package))


@pytest.fixture(scope="module")
def reference(default_package: Path, tokenizer: Tokenizer):
    transformers = pytest.importorskip("transformers")
    package = open_package(default_package)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(package.tokenizer_json_path),
        chat_template=package.chat_template,
        eos_token=tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0]),
    )


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one_turn", "system_and_turns"])
def test_chat_prompt_equals_transformers_apply_chat_template(tokenizer: Tokenizer, reference, messages) -> None:
    assert tokenizer.render_chat(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    expected_ids = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert tokenizer.encode_chat(messages) == list(expected_ids)


def test_the_default_template_starts_with_its_system_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.render_chat(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_ids == (2,)


def test_streaming_the_real_tokenizer_token_by_token_equals_decoding_the_whole(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode_chat(CONVERSATIONS[0])
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        pieces = [detokenizer.push([token]) for token in ids] + [detokenizer.flush()]
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)
