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

from flare.daemon.abandonable import run_abandonable
from flare.daemon.errors import bad_request
from flare.daemon.http_api import SETTINGS, STATE, TOKENIZING, expect_continue, read_body
from flare.daemon.openai_schema import chat_messages, check_fields, check_model, kind, parse_json_body
from flare.daemon.prepare import check_prompt_size
from flare.daemon.tool_calls import render_messages, template_messages
from flare.engine.tokenizer import ChatTemplateError
from flare.preparation.chat_template import ChatTemplateLimit

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
    else:
        _no_field(body, "add_special_tokens", "messages")
        messages = chat_messages(body["messages"])
        if any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            # As the chat endpoint writes a conversation with tool turns (flare/daemon/tool_calls.py).
            messages = tuple(template_messages(messages) if tokenizer.knows_tools else render_messages(messages, None))
        check_prompt_size(scheduler, sum(len(m["content"] or "") for m in messages), "messages")
        encode = partial(
            tokenizer.encode_chat,
            messages,
            _flag(body, "add_generation_prompt", True),
            special_tokens_in_content=request.app[SETTINGS].config.allow_special_tokens_in_messages,
        )
    try:
        # A chat template renders in a thread the daemon never waits for at exit (abandonable.py).
        tokens = await run_abandonable(encode, limiter=request.app[TOKENIZING], name="tokenize")
    except ChatTemplateError as error:
        limit = isinstance(error, ChatTemplateLimit)
        raise bad_request(str(error), param="messages", code="chat_template_limit" if limit else None) from None
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
