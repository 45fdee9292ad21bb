"""The tokens that end a generation: the source's end-of-sequence ids, and the end-of-turn
tokens its chat template closes a turn with.

A source declares its stop ids in more than one place, and every family fills them differently:
a Hugging Face directory in config.json and generation_config.json (`eos_token_id`, one id or a
list: Llama 3.1 lists `<|end_of_text|>`, `<|eom_id|>` and `<|eot_id|>`), a GGUF file in
`tokenizer.ggml.eos_token_id` and `eot_token_id` (Llama 3.1's leave `<|eom_id|>` out). Some declare only the
end-of-text token while the chat model ends its turns with another (Gemma's `<end_of_turn>`,
Phi-3's `<|end|>`): a model that writes the token its template closes turns with has finished
its answer, so that token stops it too (llama.cpp ends generation on the same tokens, by text).

Harmony (gpt-oss) ends an answer with `<|return|>` or a tool call with `<|call|>`; its `<|end|>`
closes one message of the answer (the analysis before the final one), so it never stops a
generation where the vocabulary holds those two (llama.cpp's rule, llama-vocab.cpp).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from flare.preparation.source import ModelSource

# The end-of-turn tokens of the families flare serves, as their vocabularies spell them.
END_OF_TURN_TOKENS = (
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|return|>", "<|call|>",
)
# Harmony's answer ends: where the vocabulary holds both, `<|end|>` ends a message, not the answer.
_HARMONY_ENDS = ("<|return|>", "<|call|>")


def template_turn_ends(tokenizer_json: str, chat_template: str) -> list[int]:
    """The ids of the end-of-turn tokens that the chat template writes and the vocabulary holds
    as special (control) tokens, in END_OF_TURN_TOKENS' order."""
    added = json.loads(tokenizer_json).get("added_tokens") or []
    special = {token["content"]: int(token["id"]) for token in added if token.get("special")}
    harmony = all(text in special for text in _HARMONY_ENDS)
    return [
        special[text]
        for text in END_OF_TURN_TOKENS
        if text in special and text in chat_template and not (harmony and text == "<|end|>")
    ]


def stop_token_ids(declared: Sequence[int], tokenizer_json: str, chat_template: str) -> tuple[int, ...]:
    """`declared` (the source's own, in its order: the first is the `eos_token` templates see),
    then the template's end-of-turn tokens it lacks."""
    ids = list(dict.fromkeys(int(token) for token in declared))
    ids += [token for token in template_turn_ends(tokenizer_json, chat_template) if token not in ids]
    return tuple(ids)


def with_template_stop_tokens(model: ModelSource) -> ModelSource:
    """`model` with its chat template's end-of-turn tokens added to its stop ids."""
    ids = stop_token_ids(model.config.eos_token_ids, model.tokenizer_json, model.chat_template)
    if ids == model.config.eos_token_ids:
        return model
    return dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=ids))
