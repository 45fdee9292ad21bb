"""A final message continued (an assistant prefill): the prompt is the conversation through the
package's own chat template, cut at the end of the prefill's text, so the model writes on from
it instead of opening a new turn; a template that does not write the text as sent is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.engine.test_chat_content_tokens import byte_level
from tokenizers import Tokenizer as BackendTokenizer

from flare.engine.tokenizer import CannotContinue, Tokenizer
from flare.package.directory import open_package

PREFILL = '{"capital": "'
CONVERSATION = [
    {"role": "system", "content": "Answer in JSON."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": PREFILL},
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_package: Path) -> Tokenizer:
    return Tokenizer.from_package(open_package(tiny_package))


def test_the_tiny_models_prompt_ends_with_the_prefill_text(tiny_tokenizer: Tokenizer) -> None:
    continued = tiny_tokenizer.render_chat(CONVERSATION, continue_final_message=True)
    closed = tiny_tokenizer.render_chat(CONVERSATION)
    assert continued.endswith("<|im_start|>assistant\n" + PREFILL)
    # The same conversation answered afresh closes the prefill and opens another turn.
    assert closed.startswith(continued) and closed.endswith("<|im_start|>assistant\n")
    ids = tiny_tokenizer.encode_chat(CONVERSATION, continue_final_message=True)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == continued


def test_text_that_spells_the_cut_mark_is_still_continued_as_text(tiny_tokenizer: Tokenizer) -> None:
    spelled = "\ufdd0continue\ufdd1 \ufdd0 \ufdd1"
    conversation = [{"role": "user", "content": spelled}, {"role": "assistant", "content": spelled + PREFILL}]
    ids = tiny_tokenizer.encode_chat(conversation, continue_final_message=True)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\n" + spelled + PREFILL)


def test_an_empty_prefill_opens_the_assistant_turn(tiny_tokenizer: Tokenizer) -> None:
    conversation = [*CONVERSATION[:2], {"role": "assistant", "content": ""}]
    assert tiny_tokenizer.render_chat(conversation, continue_final_message=True) == tiny_tokenizer.render_chat(
        CONVERSATION[:2]
    )


def _with_template(template: str) -> Tokenizer:
    tokenizer = byte_level()
    return Tokenizer(BackendTokenizer.from_str(tokenizer.backend.to_str()), template, eos_token_ids=tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    "template",
    [
        # writes every assistant message twice
        "{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}{% endfor %}",
        # drops the assistant's content
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}",
        # rewrites it
        "{% for m in messages %}{{ m['content'] | replace('capital', 'CAPITAL') }}{% endfor %}",
    ],
    ids=["twice", "dropped", "rewritten"],
)
def test_a_template_that_does_not_write_the_prefill_as_sent_cannot_continue_it(template: str) -> None:
    tokenizer = _with_template(template)
    with pytest.raises(CannotContinue):
        tokenizer.encode_chat(CONVERSATION, continue_final_message=True)
