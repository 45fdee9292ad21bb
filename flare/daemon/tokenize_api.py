"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes: clients count a prompt's tokens
before sending it, and turn token ids (logprobs, a completions prompt) back into text.

/tokenize takes `prompt` (text, tokenized as /v1/completions does) or `messages` (the chat
template applied as /v1/chat/completions does, `add_generation_prompt` true unless said) and
answers `{"tokens": [...], "count": n, "max_model_len": m}`; /detokenize takes `tokens` and
answers `{"prompt": "..."}`. Both sit behind the same middlewares as the other endpoints (API
keys, origins, body limits), and tokenize in the same bounded worker threads, off the event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import anyio
from aiohttp import web

from flare.daemon.errors import bad_request
from flare.daemon.generation import ChatPrompt
from flare.daemon.http_api import COMPILING, SETTINGS, STATE, TOKENIZING, expect_continue, read_body
from flare.daemon.openai_schema import chat_messages, check_fields, check_model, kind, parse_json_body
from flare.daemon.prepare import Serving, chat_ids, check_prompt_size

_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize, expect_handler=expect_continue)
    app.router.add_post("/detokenize", detokenize, expect_handler=expect_continue)


async def tokenize(request: web.Request) -> web.Response:
    body = parse_json_body(await read_body(request))
    check_fields(body, _TOKENIZE_FIELDS)
    scheduler = request.app[STATE].require_scheduler()
    _check_model(body, request.app[STATE].model_name or "")
    tokenizer = scheduler.tokenizer
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("send either prompt (a string) or messages (a chat), exactly one of them", param="prompt")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request(f"prompt must be a string, got {kind(prompt)}", param="prompt")
        _no_field(body, "add_generation_prompt", "prompt")
        add_special = _flag(body, "add_special_tokens", True)
        check_prompt_size(scheduler, len(prompt), "prompt")
        encode = partial(tokenizer.encode, prompt, add_special_tokens=add_special)
        tokens = await anyio.to_thread.run_sync(encode, limiter=request.app[TOKENIZING])
    else:
        _no_field(body, "add_special_tokens", "messages")
        # As the chat endpoint renders the conversation (prepare.chat_ids), tool turns included.
        serving = Serving(scheduler, request.app[SETTINGS].config, request.app[TOKENIZING], request.app[COMPILING])
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        tokens = list(await chat_ids(serving, ChatPrompt(chat_messages(body["messages"])), add_generation_prompt))
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": scheduler.max_context})


async def detokenize(request: web.Request) -> web.Response:
    body = parse_json_body(await read_body(request))
    check_fields(body, _DETOKENIZE_FIELDS)
    scheduler = request.app[STATE].require_scheduler()
    _check_model(body, request.app[STATE].model_name or "")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request(f"tokens is required: a list of token ids, got {kind(tokens)}", param="tokens")
    vocab = scheduler.tokenizer.vocab_size
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int):
            raise bad_request(f"tokens[{index}] must be an integer token id, got {kind(token)}", param="tokens")
        if not 0 <= token < vocab:
            raise bad_request(
                f"tokens[{index}] is {token}, outside this model's vocabulary of {vocab} tokens (ids 0 to {vocab - 1})",
                param="tokens",
            )
    text = await anyio.to_thread.run_sync(
        partial(scheduler.tokenizer.decode, tokens, skip_special_tokens=False), limiter=request.app[TOKENIZING]
    )
    return web.json_response({"prompt": text})


def _check_model(body: Mapping[str, Any], served: str) -> None:
    """`model` is optional here (as in vLLM); when sent, it must name the served model."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {kind(model)}", param="model")
    check_model(model, served)


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
