"""Chat templates render as transformers' apply_chat_template does, sandboxed, with clear errors."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from flare.engine.tokenizer import ChatTemplateError, Tokenizer

# SmolLM2-135M-Instruct's template (from its GGUF): ChatML with a default system prompt.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3 style: bos_token, whitespace control, trim_blocks/lstrip_blocks, raise_exception, tojson,
# loop controls and namespace.
LLAMA_STYLE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == (1 if ns.system else 0)) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + eos_token }}
{% endfor %}
{% if ns.system %}{{ 'system: ' + (ns.system | tojson) }}{% endif %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word. \"Quotes\" and ünïcødé 日本"},
        {"role": "user", "content": "Capital of Japan?"},
        {"role": "assistant", "content": "Tokyo"},
        {"role": "user", "content": "  And of Italy?  "},
    ],
]


def word_tokenizer(template: str) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + ["[UNK]"])}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return Tokenizer(backend, template, eos_token_ids=[2], bos_token_id=1)


def transformers_render(tokenizer: Tokenizer, template: str, messages, add_generation_prompt: bool) -> str:
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend, bos_token="<s>", eos_token="</s>", chat_template=template
    )
    return reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, LLAMA_STYLE_TEMPLATE], ids=["smollm2", "llama_style"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one_turn", "system_and_turns"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_equals_transformers_apply_chat_template(template, messages, add_generation_prompt) -> None:
    tokenizer = word_tokenizer(template)
    rendered = tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == transformers_render(tokenizer, template, messages, add_generation_prompt)


def test_encode_chat_adds_no_bos_of_its_own() -> None:
    tokenizer = word_tokenizer(SMOLLM2_TEMPLATE)
    ids = tokenizer.encode_chat(CONVERSATIONS[0])
    assert ids[0] == tokenizer.backend.token_to_id("<|im_start|>")
    assert ids.count(tokenizer.backend.token_to_id("<|im_start|>")) == 3


def test_a_template_that_raises_gives_a_chat_template_error() -> None:
    tokenizer = word_tokenizer(LLAMA_STYLE_TEMPLATE)
    messages = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tokenizer.render_chat(messages)


def test_a_template_that_does_not_compile_is_refused_up_front() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        word_tokenizer("{% for m in messages %}{{ m['content'] }")


def test_the_sandbox_refuses_to_reach_python_internals() -> None:
    tokenizer = word_tokenizer("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        tokenizer.render_chat(CONVERSATIONS[0])


def test_a_message_without_content_is_a_template_error_not_a_crash() -> None:
    tokenizer = word_tokenizer(SMOLLM2_TEMPLATE)
    with pytest.raises(ChatTemplateError):
        tokenizer.render_chat([{"role": "user"}])
