"""What every API's parser hands to the one request path: a `Generation`.

Chat completions, completions, the Responses API and Anthropic's Messages API each parse their
own body (chat/parse.py, responses/parse.py, messages/parse.py) into this one shape;
`prepare` (prepare.py) turns it into scheduler requests, whichever API it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare.api.tools.parse import ToolRequest
from flare.structured.spec import GrammarSpec


@dataclass(frozen=True)
class TokenOptions:
    """What a request asks about tokens besides sampling: log-probabilities, echo, logit_bias."""

    logprobs: int | None = None  # None: none; k: each output token's with k alternatives
    echo: bool = False  # completions: the prompt is part of the answer (scored with logprobs)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    raw_logprobs: bool = False  # logprobs_mode "raw": the model's distribution, nothing applied


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered by the package's chat template.

    `messages` are OpenAI chat messages with plain-text content: {"role", "content"}, plus
    "tool_calls" on an assistant message and "tool_call_id" on a tool message.

    `continues`: the request field that asks for the final message, an assistant's, to be
    continued (Anthropic's prefill, chat's `continue_final_message`); None: the answer is a new
    assistant turn."""

    messages: tuple[Mapping[str, Any], ...]
    tools: ToolRequest | None = None
    param: str = "messages"  # the request field errors about the prompt name
    continues: str | None = None


TextOrTokens = str | tuple[int, ...]


@dataclass(frozen=True)
class TextPrompts:
    """Completions' prompts: each a text (tokenized here) or token ids (checked against the
    vocabulary); each runs as a sequence of the same request."""

    prompts: tuple[TextOrTokens, ...]
    param: str = "prompt"


@dataclass(frozen=True)
class ThinkingSwitch:
    """A request's switch of the model's reasoning (chat's `reasoning_effort`, Responses'
    `reasoning.effort`, Anthropic's `thinking`, `chat_template_kwargs.enable_thinking`), and
    the field that set it, which errors name."""

    enabled: bool
    param: str
    effort: str | None = None  # the effort asked for, where the field names one (api/fields.py REASONING_EFFORTS)


@dataclass(frozen=True)
class Generation:
    """One generation request, whichever API it came in through."""

    model: str
    prompt: ChatPrompt | TextPrompts
    sampling: Mapping[str, Any]  # validated raw sampling fields (validate_request_sampling)
    stream: bool = False
    n: int = 1  # choices sampled independently from each prompt
    tokens: TokenOptions = TokenOptions()
    # response format or structured_outputs; the tools' grammar is prepare's (the package's format)
    constraint: GrammarSpec | None = None
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    cache_salt: str | None = None  # narrows whose prefix-cache blocks it shares (api/cache_scope.py)
    # OpenAI's labels, logged with the request: the end user's (safety_identifier) and the
    # cache-routing hint (prompt_cache_key; one scheduler has no routing to do, api/cache_scope.py).
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # The served model's name when `model` named another and --accept-any-model-name answered
    # it: the answer echoes `model`, its flare object says what served it.
    model_mapped_to: str | None = None
    # OpenAI's predicted outputs: text the answer is expected to repeat, drafted from (chat only).
    prediction: str | None = None
    thinking: ThinkingSwitch | None = None  # None: the template's default

    @property
    def tools(self) -> ToolRequest | None:
        return self.prompt.tools if isinstance(self.prompt, ChatPrompt) else None

    @property
    def calls_possible(self) -> bool:
        return self.tools is not None and self.tools.calls_possible
