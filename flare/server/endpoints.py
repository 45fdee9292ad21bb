"""One handler per URL (the route table is routes.py): health and models, the generation
endpoints of every API (read the body, parse it with the API's parser, then the one path:
prepare, answer with the API's renderer), Ollama's model endpoints, and /tokenize, /detokenize."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from aiohttp import web

from flare.api.answer import GENERATED, answer
from flare.api.cache_scope import prefix_cache_scope
from flare.api.chat.parse import parse_chat_completion, parse_completion
from flare.api.chat.render import CHAT_IDS, COMPLETION_IDS, ChatCompletionShape, OpenAIRenderer, TextCompletionShape
from flare.api.errors import ApiError, bad_request
from flare.api.fields import check_fields, check_model
from flare.api.generation import Generation
from flare.api.json_body import parse_json_body
from flare.api.messages.parse import parse_messages_request
from flare.api.messages.render import MESSAGE_IDS, MessagesRenderer
from flare.api.ollama.models import ModelFacts, model_entry, running_entry, show_body
from flare.api.ollama.parse import OllamaRequest, parse_ollama_chat, parse_ollama_generate, served_name
from flare.api.ollama.render import NDJSON_HEADERS, OLLAMA_IDS, OllamaRenderer, loaded_body
from flare.api.prepare import Prepared, Serving, chat_ids, check_prompt_size, count_prompt_tokens, prepare
from flare.api.rendering import IdForm, Renderer
from flare.api.sse import SSE_HEADERS
from flare.api.responses.items import input_items
from flare.api.responses.parse import parse_response_request, parse_storing
from flare.api.responses.render import RESPONSE_IDS, ResponsesRenderer
from flare.api.responses.store import ResponseStore, StoredResponse, owner_of
from flare.api.tokenize.parse import (
    DETOKENIZE_FIELDS,
    TOKENIZE_FIELDS,
    check_model_if_named,
    parse_detokenize,
    parse_tokenize,
)
from flare.api.tokenize.render import detokenize_body, tokenize_body
from flare.sampler.status import DeviceStatus
from flare.scheduler.request import FaultSpec
from flare.server.context import API_KEY, COMPILING, RESPONSE_STORE, SETTINGS, STATE, TOKENIZING, ServerConfig
from flare.server.request_body import read_body
from flare.server.state import Phase

if TYPE_CHECKING:
    from flare.scheduler.scheduler import Scheduler

FAULT_HEADER = "X-Flare-Fault"


# --- health and models ---------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """200 only when the model is loaded, warmed up and admitting requests; 503 otherwise."""
    state = request.app[STATE]
    status = state.phase.value
    if state.phase is Phase.READY and state.require_scheduler().draining:
        status = "draining"
    return web.json_response({"status": status}, status=200 if status == "ready" else 503)


async def list_models(request: web.Request) -> web.Response:
    # 503 while loading: the names are known once the package is open
    names = request.app[STATE].require_names()
    return web.json_response({"object": "list", "data": [_model_card(name) for name in names.names]})


async def get_model(request: web.Request) -> web.Response:
    """The model card of a served name (or, under --accept-any-model-name, of any name)."""
    name = request.match_info["model"]
    check_model(name, request.app[STATE].require_names())
    return web.json_response(_model_card(name))


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "flare"}


# --- generation ----------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    generation = parse_chat_completion(parse_json_body(await read_body(request)))
    return await _generate(request, generation, CHAT_IDS, _chat_renderer)


async def completions(request: web.Request) -> web.StreamResponse:
    generation = parse_completion(parse_json_body(await read_body(request)))
    return await _generate(request, generation, COMPLETION_IDS, _completion_renderer)


async def responses(request: web.Request) -> web.StreamResponse:
    """The Responses API: the answer, continuing the stored response `previous_response_id`
    names (its input and output items before this input), and kept when `store` is true
    (OpenAI's default) and the operator keeps a store."""
    body = parse_json_body(await read_body(request))
    storing = parse_storing(body)
    store = request.app.get(RESPONSE_STORE)
    owner = owner_of(request[API_KEY])
    if store is None:
        _refuse_storing(body)
    earlier: list[dict[str, Any]] = []
    if storing.previous_response_id is not None:
        previous = await _previous_response(store, storing.previous_response_id, owner)
        earlier = [*previous.input_items, *previous.response["output"]]
    generation = parse_response_request(body, earlier)
    keeping = store if storing.store else None  # None: kept nowhere
    items = [*earlier, *input_items(body["input"])] if keeping is not None else []
    staged: list[str] = []

    def keep(response: dict[str, Any]) -> None:
        assert keeping is not None
        keeping.stage(StoredResponse(response["id"], owner, time.time(), items, response))
        staged.append(response["id"])

    created, instructions = int(time.time()), body.get("instructions")  # a string, or None: parsed

    def renderer(prepared: Prepared) -> Renderer:
        return ResponsesRenderer(
            prepared,
            created,
            instructions,
            store=keeping is not None,
            previous_response_id=storing.previous_response_id,
            keep=keep if keeping is not None else None,
        )

    try:
        return await _generate(request, generation, RESPONSE_IDS, renderer)
    finally:
        # Committed before the handler ends, whatever ended it; the client may already hold it.
        with anyio.CancelScope(shield=True):
            for response_id in staged:
                assert keeping is not None
                await keeping.commit(response_id)


def _refuse_storing(body: dict[str, Any]) -> None:
    """With the store off, what needs it is refused by name; a request that leaves `store` out
    is answered and kept nowhere."""
    if body.get("store") is True:
        raise bad_request(
            "store: true: this server keeps no responses (its operator turned the responses store off); send "
            "store: false and the whole conversation in input",
            param="store",
        )
    if body.get("previous_response_id") is not None:
        raise bad_request(
            "previous_response_id: this server keeps no responses (its operator turned the responses store off); "
            "send the whole conversation in input",
            param="previous_response_id",
        )


async def _previous_response(store: ResponseStore | None, response_id: str, owner: str) -> StoredResponse:
    """The stored response a request continues; as OpenAI answers for one it cannot find (never
    another key's)."""
    found = None if store is None else await store.get(response_id, owner)
    if found is None:
        raise bad_request(
            f"Previous response with id '{response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return found


# --- stored responses ----------------------------------------------------------------------


async def get_response(request: web.Request) -> web.Response:
    return web.json_response((await _stored_response(request)).response)


async def list_input_items(request: web.Request) -> web.Response:
    """OpenAI's list of a stored response's input items: `limit` (1-100, default 20), `order`
    (desc by default, as OpenAI's) and `after` an item's id."""
    items = (await _stored_response(request)).input_items
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be asc or desc, got {order!r}", param="order")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise bad_request(f"limit must be an integer from 1 to 100, got {limit_text!r}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise bad_request(f"after must be the id of one of this response's input items, got {after!r}", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(limit_text)]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > len(page),
        }
    )


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    store = request.app.get(RESPONSE_STORE)
    if store is None or not await store.delete(response_id, owner_of(request[API_KEY])):
        raise _response_not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def _stored_response(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    store = request.app.get(RESPONSE_STORE)
    found = None if store is None else await store.get(response_id, owner_of(request[API_KEY]))
    if found is None:
        raise _response_not_found(response_id)
    return found


def _response_not_found(response_id: str) -> ApiError:
    # Another key's response is answered exactly as one that does not exist.
    return ApiError(404, f"Response with id '{response_id}' not found.", code="not_found")


async def messages(request: web.Request) -> web.StreamResponse:
    generation = parse_messages_request(parse_json_body(await read_body(request)))
    return await _generate(request, generation, MESSAGE_IDS, MessagesRenderer)


async def count_message_tokens(request: web.Request) -> web.Response:
    """Anthropic's count_tokens: the prompt's tokens as /v1/messages would send them."""
    generation = parse_messages_request(parse_json_body(await read_body(request)), counting=True)
    serving, _ = _serving(request, generation)
    return web.json_response({"input_tokens": await count_prompt_tokens(serving, generation)})


def _chat_renderer(prepared: Prepared) -> Renderer:
    generation = prepared.generation
    shape = ChatCompletionShape(prepared.id, int(time.time()), generation.model, generation.include_usage)
    return OpenAIRenderer(shape, [None] * prepared.choices, generation.tokens.logprobs is not None)


def _completion_renderer(prepared: Prepared) -> Renderer:
    generation = prepared.generation
    shape = TextCompletionShape(prepared.id, int(time.time()), generation.model, generation.include_usage)
    echoes = [None if echo is None else echo.text for echo in prepared.echoes for _ in range(generation.n)]
    return OpenAIRenderer(shape, echoes, generation.tokens.logprobs is not None)


async def _generate(
    request: web.Request,
    generation: Generation,
    ids: IdForm,
    renderer: Callable[[Prepared], Renderer],
    stream_headers: Mapping[str, str] = SSE_HEADERS,
) -> web.StreamResponse:
    """The one request path after parsing, whichever API: prepare, then submit and render;
    `ids` is the API's form of its ids (stated beside its renderer), `stream_headers` how it
    streams (SSE, or Ollama's NDJSON)."""
    serving, generation = _serving(request, generation)
    config = request.app[SETTINGS].config
    scope = prefix_cache_scope(
        api_key=request[API_KEY], across_keys=config.prefix_cache_across_keys, salt=generation.cache_salt
    )
    prepared = await prepare(serving, generation, ids, _fault(request, config), scope)
    in_flight = request.app[STATE].in_flight
    return await answer(
        request,
        serving.scheduler,
        in_flight,
        prepared,
        renderer(prepared),
        config.request_timeout_s,
        config.stream_keepalive_s,
        stream_headers,
    )


def _serving(request: web.Request, generation: Generation) -> tuple[Serving, Generation]:
    """The running model, once `generation` names it (a 503 while loading, a 404 for another),
    and the generation, marked as mapped to the served model where --accept-any-model-name
    answered a name it does not have."""
    state = request.app[STATE]
    scheduler = state.require_scheduler()
    names = state.require_names()
    if check_model(generation.model, names):
        generation = dataclasses.replace(generation, model_mapped_to=names.primary)
    return _serving_of(request, scheduler), generation


def _serving_of(request: web.Request, scheduler: Scheduler) -> Serving:
    allow_special = request.app[SETTINGS].config.allow_special_tokens_in_messages
    return Serving(scheduler, allow_special, request.app[TOKENIZING], request.app[COMPILING])


def _fault(request: web.Request, config: ServerConfig) -> FaultSpec | None:
    """`X-Flare-Fault: STATUS_NAME[@ROUND]`, honoured only under --fault-injection."""
    header = request.headers.get(FAULT_HEADER)
    if not config.fault_injection or header is None:
        return None
    name, at, round_text = header.strip().partition("@")
    names = ", ".join(s.name for s in DeviceStatus if s is not DeviceStatus.OK)
    try:
        status = DeviceStatus[name.strip().upper()]
    except KeyError:
        raise bad_request(f"{FAULT_HEADER}: unknown status {name!r}; use one of {names}", param=FAULT_HEADER) from None
    if status is DeviceStatus.OK:
        raise bad_request(f"{FAULT_HEADER}: OK is not a fault; use one of {names}", param=FAULT_HEADER)
    if not at:
        return FaultSpec(status)
    if not round_text.strip().isdigit():
        raise bad_request(
            f"{FAULT_HEADER}: the round after @ must be a non-negative integer, got {round_text!r}", param=FAULT_HEADER
        )
    return FaultSpec(status, int(round_text))


# --- Ollama's API ---------------------------------------------------------------------------


async def ollama_chat(request: web.Request) -> web.StreamResponse:
    names = request.app[STATE].require_names().names
    parsed = parse_ollama_chat(parse_json_body(await read_body(request)), names)
    return await _ollama_generate(request, parsed, chat=True)


async def ollama_generate(request: web.Request) -> web.StreamResponse:
    body = parse_json_body(await read_body(request))
    state = request.app[STATE]
    names = state.require_names()
    parsed = parse_ollama_generate(body, names.names)
    if parsed is None:
        # No prompt: Ollama's way to load a model, which here is loaded once it is served.
        state.require_scheduler()
        check_model(served_name(body["model"], names.names), names)
        return web.json_response(loaded_body(body["model"]))
    return await _ollama_generate(request, parsed, chat=False)


async def _ollama_generate(request: web.Request, parsed: OllamaRequest, *, chat: bool) -> web.StreamResponse:
    def renderer(prepared: Prepared) -> Renderer:
        return OllamaRenderer(prepared, parsed.requested_model, lambda: request[GENERATED], chat=chat)

    return await _generate(request, parsed.generation, OLLAMA_IDS, renderer, NDJSON_HEADERS)


async def ollama_tags(request: web.Request) -> web.Response:
    """The served names, each as Ollama lists a model (a name without a tag gets `:latest`)."""
    state = request.app[STATE]
    names = state.require_names()
    facts = await _model_facts(state.require_scheduler())
    return web.json_response({"models": [model_entry(name, facts) for name in names.names]})


async def ollama_show(request: web.Request) -> web.Response:
    body = parse_json_body(await read_body(request))
    state = request.app[STATE]
    names = state.require_names()
    requested = body.get("model") or body.get("name")  # older clients send `name`
    if not isinstance(requested, str) or not requested:
        raise bad_request("model is required: the name of a served model (GET /api/tags lists them)", param="model")
    check_model(served_name(requested, names.names), names)
    scheduler = state.require_scheduler()
    return web.json_response(show_body(await _model_facts(scheduler), scheduler.policy.defaults))


async def ollama_ps(request: web.Request) -> web.Response:
    """The loaded model: the one package, under its first served name."""
    state = request.app[STATE]
    names = state.require_names()
    facts = await _model_facts(state.require_scheduler())
    return web.json_response({"models": [running_entry(names.primary, facts)]})


async def ollama_version(request: web.Request) -> web.Response:
    return web.json_response({"version": importlib.metadata.version("flare")})


async def _model_facts(scheduler: Scheduler) -> ModelFacts:
    """What Ollama's model endpoints show of the package: read off the event loop (its files' sizes)."""
    package = scheduler.package
    manifest = package.manifest

    def files() -> tuple[int, float]:
        try:
            entries = [entry.stat() for entry in os.scandir(package.path) if entry.is_file()]
            return sum(e.st_size for e in entries), os.stat(package.path).st_mtime
        except OSError:
            return 0, 0.0

    size, modified = await anyio.to_thread.run_sync(files)
    return ModelFacts(
        architecture=manifest.model.architecture,
        dtype=manifest.serving.dtype,
        context_length=scheduler.max_context,
        size=size,
        modified=modified,
        digest=hashlib.sha256(str(package.path).encode("utf-8")).hexdigest(),
    )


# --- tokenize ------------------------------------------------------------------------------


async def tokenize(request: web.Request) -> web.Response:
    body = parse_json_body(await read_body(request))
    check_fields(body, TOKENIZE_FIELDS)
    state = request.app[STATE]
    scheduler = state.require_scheduler()
    check_model_if_named(body, state.require_names())
    wanted = parse_tokenize(body)
    if wanted.prompt is not None:
        check_prompt_size(scheduler, len(wanted.prompt), "prompt")
        encode = partial(scheduler.tokenizer.encode, wanted.prompt, add_special_tokens=wanted.add_special_tokens)
        tokens = await anyio.to_thread.run_sync(encode, limiter=request.app[TOKENIZING])
    else:
        assert wanted.chat is not None
        # As the chat endpoint renders the conversation (prepare.chat_ids), tool turns included.
        serving = _serving_of(request, scheduler)
        tokens = list(await chat_ids(serving, wanted.chat, wanted.add_generation_prompt))
    return web.json_response(tokenize_body(tokens, scheduler.max_context))


async def detokenize(request: web.Request) -> web.Response:
    body = parse_json_body(await read_body(request))
    check_fields(body, DETOKENIZE_FIELDS)
    state = request.app[STATE]
    scheduler = state.require_scheduler()
    check_model_if_named(body, state.require_names())
    tokens = parse_detokenize(body, scheduler.tokenizer.vocab_size)
    text = await anyio.to_thread.run_sync(
        partial(scheduler.tokenizer.decode, tokens, skip_special_tokens=False), limiter=request.app[TOKENIZING]
    )
    return web.json_response(detokenize_body(text))
