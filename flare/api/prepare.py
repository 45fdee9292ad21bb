"""Prepare: a parsed `Generation` (any API) becomes the scheduler requests and the plan for its
answer, in one function every API shares.

In order: the prompt (a conversation through the chat template, with tools; or completions'
texts and token ids) becomes token ids off the event loop; the grammar (response format,
structured outputs, or the tools' grammar in the format the package's template teaches) is
compiled off the event loop; the sampling fields
are clamped to the package policy. Anything that cannot be served is a 400 naming the field
before the scheduler sees the request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from flare.api.abandonable import run_abandonable
from flare.api.errors import bad_request
from flare.api.generation import ChatPrompt, Generation, TextPrompts, ThinkingSwitch, TokenOptions
from flare.api.harmony import harmony_grammar
from flare.api.reasoning import after_reasoning
from flare.api.rendering import IdForm, flare_object, logprobs_object
from flare.api.tools.grammar import tool_grammar
from flare.api.tools.prompt import render_messages, template_messages, template_tools
from flare.engine.tokenizer import CannotContinue, ChatTemplateError
from flare.package.chat_template import ChatTemplateLimit
from flare.package.reasoning_formats import ReasoningFormat, opens_inside
from flare.package.tool_formats import ToolFormat
from flare.policy.policy import Adjustment, ClampResult
from flare.scheduler.request import FaultSpec, GenerationRequest
from flare.structured import Grammar, GrammarError, GrammarSpec

if TYPE_CHECKING:
    from flare.scheduler.scheduler import Scheduler

COMPILE_TIMEOUT_S = 10.0
ADJUSTED_HEADER = "Flare-Sampling-Adjusted"


@dataclass(frozen=True)
class Serving:
    """What preparing a request needs from the running daemon."""

    scheduler: Scheduler
    allow_special_tokens_in_messages: bool  # the operator's setting: special tokens in message text are tokens
    tokenizing: anyio.CapacityLimiter  # tokenizer threads (the GIL released), a few at once
    compiling: anyio.CapacityLimiter  # grammar compiles (llguidance drops the GIL), a few at once


@dataclass(frozen=True)
class Echo:
    """The prompt a completions answer starts with (echo), and its tokens (scored with logprobs)."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Prepared:
    """The scheduler requests of one API request (one per prompt, each with `n` choices) and
    what its answer needs: choice k*n + j is prompt k's choice j, as OpenAI numbers them."""

    id: str  # the answer's, in its API's form (ids.answer)
    ids: IdForm
    generation: Generation
    requests: tuple[GenerationRequest, ...]
    clamp: ClampResult
    echoes: tuple[Echo | None, ...]  # per prompt
    tool_format: ToolFormat  # how the answer's tool calls are written (the package's template decides)
    reasoning: ReasoningFormat | None = None  # how the answer's reasoning is read apart (chat prompts)
    reasoning_inside: bool = False  # the prompt opened the reasoning: the answer starts inside it

    @property
    def n(self) -> int:
        return self.generation.n

    @property
    def choices(self) -> int:
        return len(self.requests) * self.generation.n

    @property
    def tokens(self) -> TokenOptions:
        return self.generation.tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    def flare(self) -> dict[str, Any]:
        """The `flare` object: the sampling applied and what the package policy changed."""
        flare = flare_object(self.clamp)
        if self.generation.model_mapped_to is not None:
            flare["model"] = {"requested": self.generation.model, "served": self.generation.model_mapped_to}
        if self.tokens.logprobs is not None:
            flare["logprobs"] = logprobs_object(self.clamp.params, raw=self.tokens.raw_logprobs)
        return flare

    def headers(self) -> dict[str, str]:
        adjusted = ",".join(a.param for a in self.clamp.adjusted)
        return {ADJUSTED_HEADER: adjusted} if adjusted else {}


async def prepare(
    serving: Serving, generation: Generation, ids: IdForm, fault: FaultSpec | None = None, cache_scope: bytes = b""
) -> Prepared:
    """The scheduler requests for `generation` and the plan for its answer, or a 400 naming the
    field that cannot be served. `ids` is the answering API's form of its ids; `cache_scope`
    says whose prefix-cache blocks its prompts may share (api/cache_scope.py)."""
    request_id = ids.answer_id()
    scheduler = serving.scheduler
    tokens = generation.tokens
    _check_logit_bias(tokens.logit_bias, scheduler.vocab_size)
    _check_continuation(generation)
    reasoning = _reasoning_format(scheduler, generation)
    prompts = await _prompt_ids(serving, generation.prompt, _template_kwargs(reasoning, generation.thinking))
    param = generation.prompt.param
    sequences = len(prompts) * generation.n
    if len(prompts) > 1 and sequences > scheduler.max_concurrency:
        raise bad_request(
            f"{len(prompts)} prompts with n={generation.n} are {sequences} sequences, but this server runs at most "
            f"{scheduler.max_concurrency} at once (max_concurrency) and the sequences of one request run together; "
            "send fewer prompts",
            param=param,
        )
    longest = max(len(ids) for _, ids in prompts)
    room = scheduler.max_context - longest
    if room < 1:
        raise bad_request(
            f"the prompt is {longest} tokens and this model's context is {scheduler.max_context} tokens, "
            "which leaves no room for a completion; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )
    tool_format = scheduler.tokenizer.tool_format
    inside = reasoning is not None and opens_inside(_tail(scheduler, prompts[0][1]), reasoning)
    # The reasoning the answer may open with, which a grammar must leave free; None once the
    # request switched it off in a template that reads the switch.
    free = reasoning if reasoning is not None and not _switched_off(generation, reasoning, inside) else None
    constraint = generation.constraint
    if tool_format.name == "harmony" and reasoning is not None:
        constraint = harmony_grammar(generation.tools, constraint, scheduler.tokenizer.tool_tokens)
    else:
        if free is not None and constraint is not None:
            constraint = _constraint_after_reasoning(constraint, free, inside)
        if generation.tools is not None and generation.tools.calls_possible:
            constraint = tool_grammar(generation.tools, tool_format, scheduler.tokenizer.tool_tokens, free, inside)
    grammar = await _compile(serving, constraint, cache_scope)
    clamp = _clamp(scheduler, generation, room, grammar)
    prediction = await _prediction_ids(serving, generation.prediction)
    scores_prompt = tokens.echo and tokens.logprobs is not None
    requests = tuple(
        GenerationRequest(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{k}",
            prompt_token_ids=ids,
            params=clamp.params,
            fault=fault,
            n=generation.n,
            logprobs=tokens.logprobs,
            raw_logprobs=tokens.raw_logprobs,
            prompt_logprobs=tokens.logprobs if scores_prompt else None,
            grammar=grammar,
            cache_scope=cache_scope,
            prediction=prediction,
        )
        for k, (_, ids) in enumerate(prompts)
    )
    echoes = tuple(Echo(text, ids) if tokens.echo else None for text, ids in prompts)
    return Prepared(request_id, ids, generation, requests, clamp, echoes, tool_format, reasoning, inside)


def _reasoning_format(scheduler: Scheduler, generation: Generation) -> ReasoningFormat | None:
    """The reasoning format a chat answer is read with, or None (completions' text stays as
    generated); a 400 naming the field that asks a model that does not reason to reason."""
    if not isinstance(generation.prompt, ChatPrompt):
        return None
    fmt = scheduler.tokenizer.reasoning_format
    switch = generation.thinking
    if fmt is None and switch is not None and switch.enabled:
        raise bad_request(
            f"{switch.param}: this model does not reason (its chat template writes no reasoning); leave it out or "
            "switch it off",
            param=switch.param,
        )
    return fmt


# gpt-oss's template takes `reasoning_effort` low, medium or high (its system message's
# "Reasoning:" line); the efforts past either end are the nearest of them. Its reasoning cannot
# be switched off, so "none" leaves the template's default.
_HARMONY_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _template_kwargs(reasoning: ReasoningFormat | None, switch: ThinkingSwitch | None) -> dict[str, Any] | None:
    """`enable_thinking` for a template that reads it, as the request switched it; harmony's
    `reasoning_effort` (gpt-oss) as the request asked."""
    if reasoning is not None and reasoning.name == "harmony" and switch is not None and switch.effort in _HARMONY_EFFORTS:
        return {"reasoning_effort": _HARMONY_EFFORTS[switch.effort]}
    if reasoning is None or switch is None or not reasoning.switchable:
        return None
    return {"enable_thinking": switch.enabled}


def _tail(scheduler: Scheduler, ids: tuple[int, ...]) -> str:
    """The prompt's last tokens as text: enough to hold a reasoning mark the template wrote."""
    return b"".join(scheduler.tokenizer.token_bytes(t) for t in ids[-8:]).decode("utf-8", "replace")


def _switched_off(generation: Generation, reasoning: ReasoningFormat, inside: bool) -> bool:
    """Whether the request switched the reasoning off in a template that reads the switch (so
    the answer starts after it, and a grammar holds all of it)."""
    switch = generation.thinking
    return switch is not None and not switch.enabled and reasoning.switchable and not inside


def _constraint_after_reasoning(constraint: GrammarSpec, reasoning: ReasoningFormat, inside: bool) -> GrammarSpec:
    """The request's constraint, held after the reasoning: a grammar holds the answer from its
    first token, so a JSON schema's grammar lets the reasoning come first (api/reasoning.py), as
    the tools' grammar does. Any other grammar with reasoning on is a 400 naming its field:
    never is the reasoning constrained."""
    if constraint.kind == "json_schema":
        return after_reasoning(constraint, reasoning, inside)
    raise bad_request(
        f"{constraint.param}: this model reasons before it answers, and this grammar cannot yet be held after the "
        "reasoning (a JSON schema can); switch reasoning off for this request (reasoning_effort \"none\", "
        "reasoning.effort \"none\", thinking disabled, or chat_template_kwargs.enable_thinking false) to "
        "constrain the answer",
        param=constraint.param,
    )


def _check_continuation(generation: Generation) -> None:
    """A continued message's answer cannot be held to a grammar that starts the answer afresh
    (a response format, forced tool calls): a 400 naming the field that asked to continue."""
    prompt = generation.prompt
    if not isinstance(prompt, ChatPrompt) or prompt.continues is None:
        return
    forced_calls = generation.tools is not None and generation.tools.calls_possible and generation.tools.choice != "auto"
    if generation.constraint is not None or forced_calls:
        by = generation.constraint.param if generation.constraint is not None else "tool_choice"
        raise bad_request(
            f"{prompt.continues}: a continued assistant message cannot also be constrained by {by}, whose grammar "
            "starts the answer afresh; send one or the other",
            param=prompt.continues,
        )


async def count_prompt_tokens(serving: Serving, generation: Generation) -> int:
    """The prompt's tokens as a generation would send them (count_tokens), its reasoning
    switched as the request switches it."""
    reasoning = _reasoning_format(serving.scheduler, generation)
    prompts = await _prompt_ids(serving, generation.prompt, _template_kwargs(reasoning, generation.thinking))
    return sum(len(ids) for _, ids in prompts)


def _clamp(scheduler: Scheduler, generation: Generation, room: int, grammar: Grammar | None) -> ClampResult:
    clamp = scheduler.policy.clamp(generation.sampling, max_tokens_limit=room)
    bias = generation.tokens.logit_bias
    if bias:
        # The policy has no say on logit_bias: it passes through, like seed and stop.
        clamp = dataclasses.replace(clamp, params=dataclasses.replace(clamp.params, logit_bias=bias))
    if grammar is not None and clamp.params.stop:
        # A stop string could end a constrained answer before its grammar is complete (a JSON
        # object without its closing brace, finish_reason "stop"): the grammar decides the end.
        dropped = Adjustment(
            "stop", list(clamp.params.stop), [], f"{grammar.spec.param} decides where the answer ends"
        )
        clamp = dataclasses.replace(
            clamp, params=dataclasses.replace(clamp.params, stop=()), adjusted=(*clamp.adjusted, dropped)
        )
    if grammar is not None and grammar.spec.closed_objects:
        clamp = dataclasses.replace(clamp, adjusted=(*clamp.adjusted, closed_objects_adjustment(grammar.spec)))
    return clamp


async def _prompt_ids(
    serving: Serving, prompt: ChatPrompt | TextPrompts, template_kwargs: dict[str, Any] | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """Each prompt's text (for echo) and token ids."""
    if isinstance(prompt, ChatPrompt):
        return [("", await chat_ids(serving, prompt, template_kwargs=template_kwargs))]
    tokenizer = serving.scheduler.tokenizer
    vocab_size = serving.scheduler.vocab_size
    prompts: list[tuple[str, tuple[int, ...]]] = []
    for k, item in enumerate(prompt.prompts):
        where = prompt.param if len(prompt.prompts) == 1 else f"{prompt.param}[{k}]"
        if isinstance(item, str):
            check_prompt_size(serving.scheduler, len(item), prompt.param)
            ids = tuple(await anyio.to_thread.run_sync(tokenizer.encode, item, limiter=serving.tokenizing))
            if not ids:
                raise bad_request(f"{where} is empty; send at least one token of text", param=prompt.param)
            prompts.append((item, ids))
            continue
        outside = next((t for t in item if t >= vocab_size), None)
        if outside is not None:
            raise bad_request(
                f"{where} holds token id {outside}, outside this model's vocabulary of {vocab_size} tokens "
                f"(ids 0 to {vocab_size - 1})",
                param=prompt.param,
            )
        # Echo shows token ids as the text they decode to.
        text = b"".join(tokenizer.token_bytes(t) for t in item).decode("utf-8", "replace")
        prompts.append((text, item))
    return prompts


async def chat_ids(
    serving: Serving,
    prompt: ChatPrompt,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[int, ...]:
    """The conversation's token ids through the package's chat template (tool turns written as
    the template or flare's tool format wants them, `template_kwargs` switched as the request
    asks), or a 400 naming `prompt.param`."""
    tokenizer = serving.scheduler.tokenizer
    messages = prompt.messages
    encode = tokenizer.encode_chat
    if prompt.tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        if tokenizer.knows_tools:
            messages = tuple(template_messages(messages))
            encode = partial(tokenizer.encode_chat, tools=template_tools(prompt.tools))
        else:
            messages = tuple(render_messages(messages, prompt.tools, system_turn=tokenizer.takes_system_turn))
    check_prompt_size(serving.scheduler, sum(len(m["content"] or "") for m in messages), prompt.param)
    special = serving.allow_special_tokens_in_messages
    try:
        # The template renders in a thread the daemon never waits for at exit (abandonable.py).
        ids = await run_abandonable(
            partial(
                encode,
                messages,
                add_generation_prompt,
                special_tokens_in_content=special,
                continue_final_message=prompt.continues is not None,
                template_kwargs=template_kwargs,
            ),
            limiter=serving.tokenizing,
            name="chat template",
        )
    except CannotContinue as error:
        raise bad_request(f"{prompt.continues}: {error}", param=prompt.continues) from None
    except ChatTemplateError as error:
        # The package's template refused the conversation (for example roles out of order), or
        # ran past its render budget on it (package/chat_template.py).
        limit = isinstance(error, ChatTemplateLimit)
        raise bad_request(str(error), param=prompt.param, code="chat_template_limit" if limit else None) from None
    return tuple(ids)


async def _prediction_ids(serving: Serving, prediction: str | None) -> tuple[int, ...]:
    """The predicted output's token ids, as the answer would hold them (no special tokens added);
    a prediction no context could hold is refused before it is tokenized."""
    if not prediction:
        return ()
    scheduler = serving.scheduler
    fewest = scheduler.tokenizer.fewest_tokens(len(prediction))
    if fewest is not None and fewest >= scheduler.max_context:
        raise bad_request(
            f"prediction.content is {len(prediction)} characters, at least {fewest} tokens, longer than this model's "
            f"context of {scheduler.max_context} tokens could ever answer; send a shorter prediction",
            param="prediction.content",
        )
    encode = partial(scheduler.tokenizer.encode, add_special_tokens=False)
    return tuple(await anyio.to_thread.run_sync(encode, prediction, limiter=serving.tokenizing))


def check_prompt_size(scheduler: Scheduler, characters: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt too long for the context whatever its tokens:
    tokenizing a long text costs the CPU for nothing when the answer is a 400 anyway."""
    fewest = scheduler.tokenizer.fewest_tokens(characters)
    if fewest is not None and fewest >= scheduler.max_context:
        raise bad_request(
            f"the prompt is {characters} characters, at least {fewest} tokens, and this model's context is "
            f"{scheduler.max_context} tokens, which leaves no room for a completion; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


def _check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    """400 for a logit_bias token id outside the served model's vocabulary."""
    outside = [token for token, _ in bias if token >= vocab_size]
    if outside:
        raise bad_request(
            f"logit_bias names token {outside[0]}, outside this model's vocabulary of {vocab_size} tokens "
            f"(ids 0 to {vocab_size - 1})",
            param="logit_bias",
        )


async def _compile(serving: Serving, spec: GrammarSpec | None, cache_scope: bytes) -> Grammar | None:
    """The request's grammar, compiled off the event loop (or found in the cache of its
    `cache_scope`, as its prompt's blocks are), within COMPILE_TIMEOUT_S; a 400 naming the field
    for one that cannot be served."""
    if spec is None:
        return None
    grammars = serving.scheduler.grammars
    if grammars is None:
        raise bad_request(f"{spec.param}: this server does not serve structured output", param=spec.param)
    try:
        with anyio.fail_after(COMPILE_TIMEOUT_S):
            compile_scoped = partial(grammars.compile, spec, scope=cache_scope)
            return await anyio.to_thread.run_sync(compile_scoped, limiter=serving.compiling)
    except GrammarError as error:
        raise bad_request(f"{error.param}: {error.message}", param=error.param, code="invalid_grammar") from None
    except TimeoutError:
        # The compile goes on in its thread until llguidance's own limits end it; the request
        # does not wait for it.
        raise bad_request(
            f"{spec.param}: compiling it took longer than {COMPILE_TIMEOUT_S:g} s; simplify it",
            param=spec.param,
            code="invalid_grammar",
        ) from None


def closed_objects_adjustment(spec: GrammarSpec) -> Adjustment:
    """The `flare` object's report of what strict closed: additionalProperties, absent as sent,
    applied as false on the objects listed."""
    where = ", ".join(spec.closed_objects[:20]) + (" ..." if len(spec.closed_objects) > 20 else "")
    return Adjustment(
        f"{spec.param}.additionalProperties",
        None,  # type: ignore[arg-type]  # absent from the request
        False,
        f"strict: {len(spec.closed_objects)} objects without additionalProperties are closed (at {where})",
    )
