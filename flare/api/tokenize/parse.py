"""The parser of `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: clients count a
prompt's tokens before sending it, and turn token ids (logprobs, a completions prompt) back
into text.

/tokenize takes `prompt` (text, tokenized as /v1/completions does) or `messages` (the chat
template applied as /v1/chat/completions does, `add_generation_prompt` true unless said);
/detokenize takes `tokens`. Both sit behind the same middlewares as the other endpoints (API
keys, origins, body limits), and tokenize in the same bounded worker threads, off the event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare.api.chat.parse import chat_messages
from flare.api.errors import bad_request
from flare.api.fields import ServedNames, check_model, kind
from flare.api.generation import ChatPrompt

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@dataclass(frozen=True)
class TokenizeRequest:
    """Either a text prompt or a chat, with the flag that applies to it."""

    prompt: str | None
    chat: ChatPrompt | None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


def check_model_if_named(body: Mapping[str, Any], served: ServedNames) -> None:
    """`model` is optional here (as in vLLM); when sent, it must name the served model."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {kind(model)}", param="model")
    check_model(model, served)


def parse_tokenize(body: Mapping[str, Any]) -> TokenizeRequest:
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("send either prompt (a string) or messages (a chat), exactly one of them", param="prompt")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request(f"prompt must be a string, got {kind(prompt)}", param="prompt")
        _no_field(body, "add_generation_prompt", "prompt")
        return TokenizeRequest(prompt, None, add_special_tokens=_flag(body, "add_special_tokens", True))
    _no_field(body, "add_special_tokens", "messages")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    return TokenizeRequest(None, ChatPrompt(chat_messages(body["messages"])), add_generation_prompt=add_generation_prompt)


def parse_detokenize(body: Mapping[str, Any], vocab_size: int) -> list[int]:
    """The token ids, each checked against the vocabulary."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request(f"tokens is required: a list of token ids, got {kind(tokens)}", param="tokens")
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int):
            raise bad_request(f"tokens[{index}] must be an integer token id, got {kind(token)}", param="tokens")
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"tokens[{index}] is {token}, outside this model's vocabulary of {vocab_size} tokens "
                f"(ids 0 to {vocab_size - 1})",
                param="tokens",
            )
    return tokens


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {kind(value)}", param=name)
    return value


def _no_field(body: Mapping[str, Any], name: str, other: str) -> None:
    if body.get(name) is not None:
        raise bad_request(f"{name} applies only without {other}", param=name)
