"""A package's chat template: compiled in a sandbox, rendered within a budget, checked before use.

A chat template is a program (Jinja) that comes with the model, and the sandbox alone keeps it
from the file system, not from looping for ever (nested `range(100000)`), recursing until the
stack ends, or writing gigabytes. Python cannot stop a thread from outside, so the bound is
cooperative, checked from inside the render at every step the template can repeat:

- every iteration of `range` (the sandbox's own `range` bounds one range's length, not nesting),
- every call the template makes (macros, methods, filters called as functions: the sandbox's
  `call` hook), and every attribute or item it reads,
- every piece of output, as the render yields it (`Template.generate`),
- the result of `*` (which repeats strings and lists) and of `**` before it is built,

against RENDER_SECONDS of wall time and RENDER_CHARS of output. A render over either ends with
`ChatTemplateLimit`, and so does a recursion that reaches Python's limit. What no
hook sees (one single call into C that runs long, such as a filter asked to pad a string to a
gigabyte) is bounded only by the renderer's thread, which the daemon never waits for at exit.

The sandbox is Jinja's immutable one, as transformers renders templates in, with one opening
for a template that calls a list's `append` or `pop` (Kimi K2's, which pair tool results with the
calls they answer through a queue in a `namespace`): those two methods, one item a call (each
call a step of the budget), and, so that no list outside the render changes, each render of such
a template gets its own copy of the context. Other templates get neither.

`check_chat_template` is the check `flare export`, `flare inspect` and `flare run` share: the
template compiles, and renders a plain conversation within the budget (a template may refuse a
conversation, with `raise_exception`; it may not hang on it or explode).
"""

from __future__ import annotations

import contextvars
import copy
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment, SandboxedEnvironment

# A prompt past a few megabytes exceeds every context flare serves many times over; a render
# that legitimately takes a second is already pathological (a real template renders orders of
# magnitude faster).
RENDER_SECONDS = 5.0
RENDER_CHARS = 8 << 20
# The conversation the check renders: what every chat template must take.
_SAMPLE_CONVERSATIONS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "Hello."},),
    (
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye."},
    ),
)


class ChatTemplateError(ValueError):
    """The chat template failed to compile or to render these messages (a template bug or a
    message it refuses)."""


class ChatTemplateLimit(ChatTemplateError):
    """The chat template ran past its time or output budget."""


@dataclass
class _Budget:
    deadline: float
    chars: int = 0
    steps: int = field(default=0)

    def step(self) -> None:
        self.steps += 1
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimit(
                f"the chat template did not finish rendering within {RENDER_SECONDS:g} s "
                f"({self.steps} steps: it loops or recurses without end)"
            )

    def output(self, chars: int) -> None:
        self.chars += chars
        if self.chars > RENDER_CHARS:
            raise ChatTemplateLimit(f"the chat template rendered more than {RENDER_CHARS} characters")
        self.step()


# The budget of the render running in this thread (each render sets its own; renders run in
# several threads at once). None outside a render (compiling, constant folding): no bound.
_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _step() -> None:
    budget = _CURRENT.get()
    if budget is not None:
        budget.step()


# A list's methods that change it by one item, which templates use as a queue (Kimi K2's).
_LIST_QUEUE_METHODS = frozenset({"append", "pop"})


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the budget checked at its hooks (the module docstring lists them);
    `queues`: a list's append and pop allowed (on a per-render copy of the context), set by
    `compile_chat_template` for a template that calls them."""

    intercepted_binops = frozenset({"*", "**"})
    queues = False

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if self.queues and isinstance(obj, list) and attr in _LIST_QUEUE_METHODS:
            return SandboxedEnvironment.is_safe_attribute(self, obj, attr, value)
        return super().is_safe_attribute(obj, attr, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _step()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _step()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _step()
        if operator == "*":
            # Repeating a sequence: its size is known before it is built.
            count, sequence = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and hasattr(sequence, "__len__") and len(sequence) * count > RENDER_CHARS:
                raise ChatTemplateLimit(
                    f"the chat template builds a value of {len(sequence) * count} items, over {RENDER_CHARS}"
                )
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            # One power of big integers is one long C call, out of the budget's reach: its
            # result's size (bits ~ exponent * log2 base) is known before it is computed.
            if right * left.bit_length() > RENDER_CHARS:
                raise ChatTemplateLimit(f"the chat template computes a power with {right * left.bit_length()} bits")
        return super().call_binop(context, operator, left, right)


def _budgeted_range(*args: int) -> Iterator[int]:
    numbers = range(*args)
    if len(numbers) > MAX_RANGE:
        raise ChatTemplateLimit(f"the chat template asks for a range of {len(numbers)} numbers, over {MAX_RANGE}")
    for number in numbers:
        _step()
        yield number


def _raise_exception(message: str) -> None:
    # Templates call raise_exception("...") to refuse a conversation (e.g. roles out of order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON (as transformers renders).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks the assistant's text
    for training masks (SmolLM3's template and many fine-tunes write it): its body, as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension declares it a class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> _BudgetedSandbox:
    """The sandbox with the environment transformers renders chat templates in."""
    environment = _BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["range"] = _budgeted_range
    return environment


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox, with the environment transformers renders it in."""
    try:
        environment = _environment()
        tree = environment.parse(source)
        environment.queues = any(
            isinstance(call.node, jinja2.nodes.Getattr) and call.node.attr in _LIST_QUEUE_METHODS
            for call in tree.find_all(jinja2.nodes.Call)
        )
        return environment.from_string(tree)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template does not compile: {error}") from error
    except RecursionError:
        raise ChatTemplateError("the chat template does not compile: it is nested too deeply") from None


def reads_tools(source: str) -> bool:
    """Whether the chat template `source` reads the `tools` variable (Hugging Face's convention
    for the functions a model may call). Reading the variable, not naming the word: Phi-4-mini's
    template looks for a 'tools' key inside the system message, and never sees `tools`."""
    try:
        tree = _environment().parse(source)
    except (jinja2.TemplateError, RecursionError):
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(tree)


def render_within_budget(template: jinja2.Template, context: Mapping[str, Any]) -> str:
    """`template` rendered with `context`, within RENDER_SECONDS and RENDER_CHARS; raises
    ChatTemplateLimit past either, ChatTemplateError for a render that fails otherwise."""
    budget = _Budget(deadline=time.monotonic() + RENDER_SECONDS)
    token = _CURRENT.set(budget)
    try:
        pieces = []
        own = copy.deepcopy(dict(context)) if getattr(template.environment, "queues", False) else context
        for piece in template.generate(**own):
            budget.output(len(piece))
            pieces.append(piece)
        return "".join(pieces)
    except RecursionError:
        raise ChatTemplateLimit("the chat template recursed too deeply (a macro that calls itself without end)") from None
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template could not render these messages: {error}") from error
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, MemoryError) as error:
        raise ChatTemplateError(
            f"the chat template could not render these messages: {type(error).__name__}: {error}"
        ) from error
    finally:
        _CURRENT.reset(token)


def takes_system_turn(template: jinja2.Template) -> bool:
    """Whether the compiled chat template renders a conversation that opens with a system
    message (Gemma 2's refuses one with raise_exception): where flare must write its own
    instructions (the tool preamble) when the template has no system turn."""
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    context = {"messages": messages, "tools": None, "documents": None, "add_generation_prompt": True,
               "bos_token": "", "eos_token": ""}
    try:
        render_within_budget(template, context)
    except ChatTemplateError:
        return False
    return True


def check_chat_template(source: str) -> str | None:
    """Why the chat template `source` cannot be served (it does not compile, or it loops,
    recurses without end or explodes on a plain conversation), or None when it can."""
    try:
        template = compile_chat_template(source)
    except ChatTemplateError as error:
        return str(error)
    for messages in _SAMPLE_CONVERSATIONS:
        context = {
            "messages": [dict(m) for m in messages], "tools": None, "documents": None,
            "add_generation_prompt": True, "bos_token": "", "eos_token": "",
        }
        try:
            render_within_budget(template, context)
        except ChatTemplateLimit as error:
            return str(error)
        except ChatTemplateError:
            pass  # a refusal of this conversation (roles it does not take): the template works
    return None
