"""Tool calls in each format a chat template teaches (preparation/tool_formats.py): the format is read
from the template, the grammar holds a required or named call to it (on the tiny package's
tokenizer), and the reader turns the answer into OpenAI tool_calls, streamed in any pieces or
read whole, while text passes through."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flare.api.reasoning import ReasoningReader
from flare.api.tools.grammar import tool_grammar
from flare.api.tools.parse import parse_tools
from flare.api.tools.reader import ToolCallReader
from flare.package.directory import open_package
from flare.package.reasoning_formats import ReasoningFormat, reasoning_format
from flare.package.tool_formats import FLARE, KIMI, LLAMA3, MISTRAL, QWEN, ToolFormat, tool_call_format
from flare.structured import GrammarCompiler, GrammarState

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "templates"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"hours": {"type": "integer"}}, "required": ["hours"],
         "additionalProperties": False}
FUNCTIONS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
# Two calls as each format writes them; the first's string holds every format's marks.
TRICKY = "a } ] </tool_call> [TOOL_CALLS] <|tool_call_end|><|tool_call_begin|>functions.x:1 {"
ANSWERS = {
    "flare": (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"hours": 3}}</tool_call>'
    ),
    "qwen": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"hours": 3}}\n</tool_call>'
    ),
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "%s"}}, {"name": "get_time", "arguments": {"hours": 3}}]',
    "kimi": (
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "%s"}'
        '<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"hours": 3}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    ),
}
# The first call of each alone.
SINGLE = {
    "flare": ANSWERS["flare"].split("\n<tool_call>")[0],
    "qwen": ANSWERS["qwen"].split("\n<tool_call>")[0],
    "mistral": ANSWERS["mistral"].split(", {")[0] + "]",
    "kimi": ANSWERS["kimi"].split("<|tool_call_begin|>functions.get_time")[0] + "<|tool_calls_section_end|>",
}
LLAMA3_ANSWER = '{"name": "get_weather", "parameters": {"city": "%s"}}'
FORMATS = {"flare": FLARE, "qwen": QWEN, "llama3": LLAMA3, "mistral": MISTRAL, "kimi": KIMI}


@pytest.mark.parametrize(
    ("template", "expected"),
    [("qwen2.5", "qwen"), ("qwen3", "qwen"), ("llama3.1", "llama3"), ("llama3.2", "llama3"),
     ("mistral-v0.3", "mistral"), ("kimi-k2", "kimi"), ("gemma2", "flare"), ("gemma3", "flare"), ("phi3", "flare"),
     ("phi3.5", "flare"), ("phi4-mini", "flare")],
)
def test_the_format_is_the_one_the_template_teaches(template: str, expected: str) -> None:
    assert tool_call_format((TEMPLATES / f"{template}.jinja").read_text()).name == expected


def test_a_template_that_mentions_tool_calls_without_reading_tools_gets_flares_format() -> None:
    assert tool_call_format("{{ messages[0].content }} <tool_call> [TOOL_CALLS]") is FLARE


@pytest.fixture(scope="module")
def compiler(tiny_package: Path) -> GrammarCompiler:
    package = open_package(tiny_package)
    config = package.manifest.model
    return GrammarCompiler(
        package.tokenizer_json_path.read_text(), vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids
    )


def _whole(
    compiler: GrammarCompiler,
    fmt: ToolFormat,
    choice: Any,
    text: str,
    parallel: bool = True,
    reasoning: ReasoningFormat | None = None,
    inside: bool = False,
) -> bool:
    """Whether `text` is a whole answer under the tools' grammar: every token allowed, then the end."""
    tools = parse_tools({"tools": FUNCTIONS, "tool_choice": choice, "parallel_tool_calls": parallel})
    assert tools is not None
    spec = tool_grammar(tools, fmt, reasoning=reasoning, inside=inside)
    assert spec is not None
    state = GrammarState(compiler.compile(spec))
    tokens = state.grammar.tokenizer.tokenize_str(text)
    if state.valid_prefix(tokens) != len(tokens):
        return False
    state.accept(tokens)
    return state.matcher.is_accepting()  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_required_calls_follow_the_format(compiler: GrammarCompiler, name: str) -> None:
    fmt = FORMATS[name]
    answer = ANSWERS[name] % "Paris"
    assert _whole(compiler, fmt, "required", answer)
    assert not _whole(compiler, fmt, "required", answer.replace("Paris", "Rome"))  # held to the schema
    # Another format's answer is not this one's.
    other = ANSWERS["mistral" if name != "mistral" else "qwen"] % "Paris"
    assert not _whole(compiler, fmt, "required", other)
    single = SINGLE[name] % "Paris"
    assert _whole(compiler, fmt, "required", single, parallel=False)
    assert not _whole(compiler, fmt, "required", answer, parallel=False)


def test_llama3_calls_are_one_bare_object_with_parameters(compiler: GrammarCompiler) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _whole(compiler, LLAMA3, named, LLAMA3_ANSWER % "Oslo")
    assert not _whole(compiler, LLAMA3, named, LLAMA3_ANSWER.replace("parameters", "arguments") % "Oslo")
    # Its template takes one call a turn: parallel calls are not offered.
    assert not _whole(compiler, LLAMA3, "required", f"{LLAMA3_ANSWER}; {LLAMA3_ANSWER}" % ("Oslo", "Paris"))
    assert _whole(compiler, LLAMA3, "auto", "Sunny, I think.")
    assert not _whole(compiler, LLAMA3, "auto", "{not a call}")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_auto_answers_text_that_cannot_be_taken_for_calls(compiler: GrammarCompiler, name: str) -> None:
    fmt = FORMATS[name]
    assert _whole(compiler, fmt, "auto", "It is sunny.")
    assert not _whole(compiler, fmt, "auto", fmt.lead + "It is sunny.")


def _read(fmt: ToolFormat, answer: str, piece: int) -> tuple[ToolCallReader, dict[int, dict[str, str]]]:
    reader = ToolCallReader(active=True, fmt=fmt)
    calls: dict[int, dict[str, str]] = {}
    for start in range(0, len(answer), piece):
        text, deltas = reader.push(answer[start : start + piece])
        assert text == ""
        for delta in deltas:
            entry = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in delta:
                assert delta["type"] == "function" and delta["function"]["arguments"] == "" and not entry["id"]
                entry["id"], entry["name"] = delta["id"], delta["function"]["name"]
            entry["arguments"] += delta["function"]["arguments"]
    return reader, calls


@pytest.mark.parametrize("name", sorted(ANSWERS))
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_streamed_calls_rebuild_each_call_and_agree_with_the_whole_read(name: str, piece: int) -> None:
    fmt = FORMATS[name]
    answer = ANSWERS[name] % TRICKY.replace('"', '\\"')
    reader, calls = _read(fmt, answer, piece)
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": TRICKY}
    assert json.loads(calls[1]["arguments"]) == {"hours": 3}
    assert [(c.id, c.name, c.arguments) for c in reader.calls] == [
        (calls[i]["id"], calls[i]["name"], calls[i]["arguments"]) for i in (0, 1)
    ]


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_a_llama3_call_reads_its_parameters_as_the_arguments(piece: int) -> None:
    reader, calls = _read(LLAMA3, LLAMA3_ANSWER % "Oslo", piece)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [("get_weather", {"city": "Oslo"})]
    assert calls[0]["arguments"] == '{"city": "Oslo"}' and calls[0]["id"].startswith("call_")


def test_mistral_call_ids_are_nine_letters_and_digits_as_its_template_requires() -> None:
    reader, _ = _read(MISTRAL, ANSWERS["mistral"] % "Paris", 1000)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in reader.calls)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_text_passes_through_in_every_format(name: str) -> None:
    reader = ToolCallReader(active=True, fmt=FORMATS[name])
    assert reader.push("Sunny") == ("Sunny", [])
    assert reader.push(" " + FORMATS[name].lead) == (" " + FORMATS[name].lead, [])
    assert not reader.called


def test_a_mark_that_is_a_control_token_is_that_token_and_is_read_back(tiny_package: Path) -> None:
    # Mistral's vocabulary holds [TOOL_CALLS] as one control token: the grammar asks for that
    # token (not its spelling, which the model never wrote), and decoding keeps its text.
    from tokenizers import Tokenizer as BackendTokenizer

    from flare.engine.tokenizer import Tokenizer

    backend = BackendTokenizer.from_file(str(open_package(tiny_package).tokenizer_json_path))
    backend.add_special_tokens(["[TOOL_CALLS]"])
    marker = backend.token_to_id("[TOOL_CALLS]")
    tokenizer = Tokenizer(backend, (TEMPLATES / "mistral-v0.3.jinja").read_text(), eos_token_ids=(2,))
    assert tokenizer.tool_format is MISTRAL and tokenizer.tool_tokens == {"[TOOL_CALLS]": marker}
    calls = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    ids = [marker, *tokenizer.encode(calls, add_special_tokens=False), 2]
    text = tokenizer.decode(ids)
    assert text == "[TOOL_CALLS]" + calls  # <|im_end|> (2) is still skipped
    reader = ToolCallReader(active=True, fmt=MISTRAL)
    reader.push(text)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [("get_weather", {"city": "Paris"})]

    compiler = GrammarCompiler(backend.to_str(), vocab_size=backend.get_vocab_size(), eos_token_ids=(2,))
    tools = parse_tools({"tools": FUNCTIONS, "tool_choice": "required"})
    assert tools is not None
    spec = tool_grammar(tools, MISTRAL, tokenizer.tool_tokens)
    assert spec is not None and f"<[{marker}]>" in spec.source
    state = GrammarState(compiler.compile(spec))
    tokens = state.grammar.tokenizer.tokenize_str(calls)
    assert state.valid_prefix([marker, *tokens]) == len(tokens) + 1
    spelled = tokenizer.encode("[TOOL_CALLS", add_special_tokens=False) + tokenizer.encode("]", add_special_tokens=False)
    assert marker not in spelled and state.valid_prefix(spelled) == 0


QWEN3 = tool_call_format((TEMPLATES / "qwen3.jinja").read_text())
THOUGHT = "<think>\nThe user wants a <b>city</b>: Paris. </thin\n</think>\n\n"


def test_a_model_that_reasons_may_think_before_it_calls_or_answers(compiler: GrammarCompiler) -> None:
    think = reasoning_format((TEMPLATES / "qwen3.jinja").read_text())
    assert QWEN3 == QWEN and think is not None
    assert reasoning_format((TEMPLATES / "qwen2.5.jinja").read_text()) is None
    call = ANSWERS["qwen"].split("\n<tool_call>")[0] % "Paris"
    assert _whole(compiler, QWEN, "required", THOUGHT + call, reasoning=think)
    assert _whole(compiler, QWEN, "required", call, reasoning=think)
    assert _whole(compiler, QWEN, "auto", THOUGHT + "It is sunny.", reasoning=think)
    assert not _whole(compiler, QWEN, "auto", THOUGHT + "<think>again</think>It is sunny.", reasoning=think)
    assert not _whole(compiler, QWEN, "required", THOUGHT + call)  # a model that does not reason
    # Flare's own format, for a template without tools that reasons (the R1 distills'), and a
    # prompt that opened the reasoning: its end, then the calls.
    flare_call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert _whole(compiler, FLARE, "required", "Hm.</think>\n\n" + flare_call, reasoning=think, inside=True)
    assert not _whole(compiler, FLARE, "required", flare_call, reasoning=think, inside=True)


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_qwen3s_thinking_is_reasoning_and_its_call_is_read_after_it(piece: int) -> None:
    answer = THOUGHT + ANSWERS["qwen"] % "Paris"
    fmt = reasoning_format((TEMPLATES / "qwen3.jinja").read_text())
    assert fmt is not None
    reasoner, reader = ReasoningReader(fmt), ToolCallReader(active=True, fmt=QWEN3)
    reasoning = content = ""
    for start in range(0, len(answer), piece):
        thought, rest = reasoner.push(answer[start : start + piece])
        text, _ = reader.push(rest)
        reasoning, content = reasoning + thought, content + text
    assert reasoning == "\nThe user wants a <b>city</b>: Paris. </thin\n" and content == ""
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"hours": 3})
    ]
    text_reasoner, text_reader = ReasoningReader(fmt), ToolCallReader(active=True, fmt=QWEN3)
    said = "".join(text_reader.push(text_reasoner.push(c)[1])[0] for c in THOUGHT + "Sunny.")
    assert said == "Sunny." and not text_reader.called


def test_kimi_k2_thinking_reasons_before_its_call_section(compiler: GrammarCompiler) -> None:
    template = (Path(__file__).parents[2] / "fixtures" / "templates" / "kimi-k2-thinking.jinja").read_text()
    think = reasoning_format(template)
    assert tool_call_format(template) is KIMI and think is not None
    call = SINGLE["kimi"] % "Oslo"
    assert _whole(compiler, KIMI, "required", "<think>It is in Norway.</think>" + call, reasoning=think)
    assert _whole(compiler, KIMI, "auto", "<think>Nothing to call.</think>It is sunny.", reasoning=think)
    assert not _whole(compiler, KIMI, "required", "<think>x</think>" + call.replace("get_weather", "get_wind"), reasoning=think)
    reasoner, reader = ReasoningReader(think), ToolCallReader(active=True, fmt=KIMI)
    thought, rest = reasoner.push("<think>It is in Norway.</think>" + call)
    text, _ = reader.push(rest)
    assert (thought, text) == ("It is in Norway.", "")
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [("get_weather", {"city": "Oslo"})]
