"""gpt-oss's harmony format: its template renders conversations as harmony (golden strings), and
its answers are read apart into reasoning (analysis channel), text (final channel) and tool calls
(commentary messages to a function), streamed in any pieces, through chat completions,
Responses and Messages."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tests.fake_scheduler import FakeScheduler

from flare.api.errors import ApiError
from flare.api.harmony import HarmonyReader, harmony_grammar
from flare.api.tools.parse import parse_tools
from flare.api.tools.prompt import template_messages
from flare.daemon.config import DaemonConfig
from flare.package import reasoning_formats, tool_formats
from flare.package.chat_template import check_chat_template, compile_chat_template, render_within_budget
from flare.server.metrics import DaemonMetrics
from flare.server.routes import create_app
from flare.server.state import ServingState
from flare.structured import GrammarCompiler, GrammarSpec, GrammarState

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "templates" / "gpt-oss.jinja").read_text()
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city."}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}


def system_turn(tools: bool = False) -> str:
    date = datetime.now().strftime("%Y-%m-%d")
    calls = "\nCalls to these tools must go to the commentary channel: 'functions'." if tools else ""
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: medium\n\n"
        f"# Valid channels: analysis, commentary, final. Channel must be included for every message.{calls}<|end|>"
    )


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    template = compile_chat_template(TEMPLATE)
    context = {"messages": template_messages(messages), "tools": tools, "add_generation_prompt": True}
    return render_within_budget(template, context)


def test_the_gpt_oss_template_is_read_as_harmony_for_calls_and_reasoning() -> None:
    assert check_chat_template(TEMPLATE) is None
    assert tool_formats.tool_call_format(TEMPLATE) is tool_formats.HARMONY
    assert reasoning_formats.reasoning_format(TEMPLATE) is reasoning_formats.HARMONY
    # Decoding keeps the text of every control token the harmony reader reads.
    assert set(tool_formats.HARMONY_TOKENS) <= set(tool_formats.HARMONY.marks)


def test_a_conversation_renders_as_harmony_with_earlier_answers_on_the_final_channel() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(messages) == (
        system_turn()
        + "<|start|>user<|message|>Hi<|end|>"
        + "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
        + "<|start|>user<|message|>Bye<|end|><|start|>assistant"
    )


def test_tools_render_as_a_typescript_namespace_and_a_call_and_its_result_as_commentary() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert render(messages, [WEATHER_TOOL]) == (
        system_turn(tools=True)
        + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
        + "// The weather in a city.\ntype get_weather = (_: {\n// The city.\ncity: string,\nunit?: \"c\" | \"f\",\n}) => any;\n\n"
        + "} // namespace functions<|end|>"
        + "<|start|>user<|message|>Weather in Paris?<|end|>"
        + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        + '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        + "<|start|>assistant"
    )


def test_an_earlier_call_keeps_its_reasoning_until_an_answer_follows_it() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    turns = [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "thinking": "Look it up.", "tool_calls": [call]},
             {"role": "tool", "content": "9C"}]
    analysis = "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
    assert analysis in render(turns, [WEATHER_TOOL])
    answered = [*turns, {"role": "assistant", "content": "9C in Oslo."}, {"role": "user", "content": "Thanks"}]
    assert analysis not in render(answered, [WEATHER_TOOL])


# What gpt-oss writes after `<|start|>assistant`: reasoning, then a call; or reasoning, then an answer.
CALL_ANSWER = (
    "<|channel|>analysis<|message|>Need the weather for Paris.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
TEXT_ANSWER = "<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"


def tokens_of(text: str, size: int) -> list[str]:
    """`text` in pieces as a tokenizer decodes it: each control token whole, the text between in
    pieces of `size` characters (a control token's text split apart too where size is 1)."""
    pieces: list[str] = []
    for part in text.replace("<|", "\0<|").replace("|>", "|>\0").split("\0"):
        if part.startswith("<|") and part.endswith("|>") and size > 1:
            pieces.append(part)
        else:
            pieces.extend(part[i : i + size] for i in range(0, len(part), size))
    return pieces


def read(text: str, size: int) -> tuple[str, str, list[dict[str, Any]], HarmonyReader]:
    reader = HarmonyReader()
    reasoning, answer, deltas = "", "", []
    for piece in tokens_of(text, size):
        r, a = reader.push(piece)
        _, d = reader.calls.push(a)
        reasoning, answer, deltas = reasoning + r, answer + a, deltas + d
    r, a = reader.flush()
    _, d = reader.calls.push(a)
    return reasoning + r, answer + a, deltas + d, reader


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_reasoning_then_a_call_streams_the_reasoning_and_the_calls_deltas_in_any_pieces(size: int) -> None:
    reasoning, answer, deltas, reader = read(CALL_ANSWER, size)
    assert reasoning == "Need the weather for Paris." and answer == ""
    first = deltas[0]
    assert first == {"index": 0, "id": first["id"], "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert [(c.name, c.arguments) for c in reader.calls.calls] == [("get_weather", '{"city": "Paris"}')]
    assert reader.calls.called and reader.calls.calls[0].id == first["id"]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_reasoning_then_the_final_channel_is_reasoning_then_text_and_no_mark_leaks(size: int) -> None:
    reasoning, answer, deltas, reader = read(TEXT_ANSWER + "<|return|>", size)
    assert (reasoning, answer, deltas, reader.calls.called) == ("Greet back.", "Hello there!", [], False)


def test_a_recipient_before_the_channel_and_a_preamble_on_commentary_are_read_too() -> None:
    text = (
        "<|channel|>commentary<|message|>Checking.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    )
    reasoning, answer, _, reader = read(text, 4)
    assert (reasoning, answer) == ("", "Checking.")
    assert [(c.name, c.arguments) for c in reader.calls.calls] == [("get_weather", '{"city": "Oslo"}')]


def test_text_without_any_harmony_header_is_the_answer_and_an_unfinished_header_is_nothing() -> None:
    assert read("Just text.", 3)[:2] == ("", "Just text.")
    assert read("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant", 1)[:2] == ("Hm.", "")


# Through the APIs, on a fake scheduler whose tokenizer reads harmony.
MODEL = "tiny-model"


def harmony_scheduler(answer: str, compiler: GrammarCompiler | None = None) -> FakeScheduler:
    """A fake scheduler that answers `answer` (not held to the request's grammar, which it compiles
    where given a compiler) and whose tokenizer reads harmony."""
    scheduler = FakeScheduler(reply=tuple(tokens_of(answer, 4)))
    scheduler.tokenizer.reasoning_format = reasoning_formats.HARMONY
    scheduler.tokenizer.tool_format = tool_formats.HARMONY
    scheduler.grammars = compiler  # type: ignore[assignment]
    return scheduler


@pytest.fixture(scope="module")
def compiler(tiny_package: Path) -> GrammarCompiler:
    from flare.package.directory import open_package

    package = open_package(tiny_package)
    config = package.manifest.model
    return GrammarCompiler(package.tokenizer_json_path.read_text(), vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids)


@pytest.fixture
async def serve(compiler: GrammarCompiler) -> AsyncIterator[Any]:
    clients: list[TestClient] = []

    async def start(answer: str) -> TestClient:
        state = ServingState()
        state.ready(harmony_scheduler(answer, compiler), (MODEL,))  # type: ignore[arg-type]
        client = TestClient(TestServer(create_app(DaemonConfig(), state, DaemonMetrics.create())))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


def sse_data(raw: str) -> list[Any]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]}


async def test_chat_returns_the_analysis_as_reasoning_content_and_the_call_as_tool_calls(serve: Any) -> None:
    client = await serve(CALL_ANSWER)
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 200, await response.text()
    choice = (await response.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "Need the weather for Paris." and not message["content"]
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["id"].startswith("call_")


async def test_chat_stream_sends_reasoning_then_the_calls_deltas(serve: Any) -> None:
    client = await serve(CALL_ANSWER)
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    chunks = sse_data(await response.text())
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Need the weather for Paris."
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [call for d in deltas for call in d.get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "tool_calls"


async def test_chat_answer_on_the_final_channel_is_the_content(serve: Any) -> None:
    client = await serve(TEXT_ANSWER)
    message = (await (await client.post("/v1/chat/completions", json=CHAT)).json())["choices"][0]["message"]
    assert message["content"] == "Hello there!" and message["reasoning_content"] == "Greet back."


async def test_responses_give_a_reasoning_item_and_a_function_call_item(serve: Any) -> None:
    client = await serve(CALL_ANSWER)
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": [{"type": "function", **WEATHER_TOOL["function"]}]}
    response = await client.post("/v1/responses", json=body)
    assert response.status == 200, await response.text()
    reasoning, call = (await response.json())["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Need the weather for Paris."}]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["arguments"] == '{"city": "Paris"}'


async def test_messages_give_a_thinking_block_and_a_tool_use_block(serve: Any) -> None:
    client = await serve(CALL_ANSWER)
    tool = {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool]}
    response = await client.post("/v1/messages", json=body)
    assert response.status == 200, await response.text()
    answer = await response.json()
    thinking, tool_use = answer["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "Need the weather for Paris."
    assert tool_use["type"] == "tool_use" and tool_use["name"] == "get_weather" and tool_use["input"] == {"city": "Paris"}
    assert answer["stop_reason"] == "tool_use"


async def test_responses_stream_the_reasoning_then_the_calls_arguments(serve: Any) -> None:
    client = await serve(CALL_ANSWER)
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": [{"type": "function", **WEATHER_TOOL["function"]}], "stream": True}
    events = sse_data(await (await client.post("/v1/responses", json=body)).text())
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert reasoning == "Need the weather for Paris." and arguments == '{"city": "Paris"}'
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "function_call"]


async def test_messages_stream_the_thinking_then_the_tool_uses_input(serve: Any) -> None:
    client = await serve(CALL_ANSWER)
    tool = {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "Weather?"}], "tools": [tool], "stream": True}
    events = sse_data(await (await client.post("/v1/messages", json=body)).text())
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Need the weather for Paris."
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == {"city": "Paris"}


@pytest.mark.parametrize(("effort", "rendered"), [("low", "low"), ("xhigh", "high"), ("minimal", "low")])
async def test_the_requests_reasoning_effort_reaches_the_templates_reasoning_line(effort: str, rendered: str) -> None:
    scheduler = harmony_scheduler(TEXT_ANSWER)
    state = ServingState()
    state.ready(scheduler, (MODEL,))  # type: ignore[arg-type]
    async with TestClient(TestServer(create_app(DaemonConfig(), state, DaemonMetrics.create()))) as client:
        response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT["messages"], "reasoning_effort": effort})
        assert response.status == 200
    assert scheduler.tokenizer.template_kwargs == {"reasoning_effort": rendered}
    template = compile_chat_template(TEMPLATE)
    prompt = render_within_budget(template, {"messages": CHAT["messages"], "add_generation_prompt": True, "reasoning_effort": rendered})
    assert f"Reasoning: {rendered}\n" in prompt


def test_a_tokenizer_with_harmonys_control_tokens_encodes_them_whole_and_decodes_them_for_the_reader(tiny_package: Path) -> None:
    from tokenizers import Tokenizer as BackendTokenizer

    from flare.engine.tokenizer import Tokenizer
    from flare.package.directory import open_package

    backend = BackendTokenizer.from_file(str(open_package(tiny_package).tokenizer_json_path))
    backend.add_special_tokens(list(tool_formats.HARMONY_TOKENS))
    ids = {name: backend.token_to_id(name) for name in tool_formats.HARMONY_TOKENS}
    tokenizer = Tokenizer(backend, TEMPLATE, eos_token_ids=(ids["<|return|>"], ids["<|call|>"]))
    assert tokenizer.tool_format is tool_formats.HARMONY and tokenizer.reasoning_format is reasoning_formats.HARMONY
    assert tokenizer.tool_tokens == ids

    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi <|end|>"}], tools=[WEATHER_TOOL])
    assistant = tokenizer.encode("assistant", add_special_tokens=False)
    assert prompt[-len(assistant) - 1 :] == [ids["<|start|>"], *assistant]
    assert prompt.count(ids["<|end|>"]) == 3  # system, developer and user turns: the user's text is text

    answer = []
    for piece in tokens_of(CALL_ANSWER, 1000):
        answer += [ids[piece]] if piece in ids else tokenizer.encode(piece, add_special_tokens=False)
    text = tokenizer.decode([*answer, ids["<|call|>"]])
    assert text == CALL_ANSWER + "<|call|>"
    reader = HarmonyReader()
    reasoning, _ = reader.push(text)
    assert reasoning == "Need the weather for Paris."
    assert [(c.name, c.arguments) for c in reader.calls.calls] == [("get_weather", '{"city": "Paris"}')]



@pytest.fixture(scope="module")
def harmony_vocabulary(tiny_package: Path) -> tuple[GrammarCompiler, dict[str, int]]:
    """A compiler over the tiny vocabulary with harmony's control tokens added, and their ids."""
    from tokenizers import Tokenizer as BackendTokenizer

    from flare.package.directory import open_package

    backend = BackendTokenizer.from_file(str(open_package(tiny_package).tokenizer_json_path))
    backend.add_special_tokens(list(tool_formats.HARMONY_TOKENS))
    ids = {name: backend.token_to_id(name) for name in tool_formats.HARMONY_TOKENS}
    compiler = GrammarCompiler(backend.to_str(), vocab_size=backend.get_vocab_size(), eos_token_ids=(ids["<|return|>"], ids["<|call|>"]))
    return compiler, ids


def whole(vocabulary: tuple[GrammarCompiler, dict[str, int]], spec: GrammarSpec, text: str) -> bool:
    """Whether `text` (its control tokens as those tokens) is a whole answer under `spec`."""
    compiler, ids = vocabulary
    state = GrammarState(compiler.compile(spec))
    tokens: list[int] = []
    for piece in tokens_of(text, 1000):
        tokens += [ids[piece]] if piece in ids else state.grammar.tokenizer.tokenize_str(piece)
    if state.valid_prefix(tokens) != len(tokens):
        return False
    state.accept(tokens)
    return state.matcher.is_accepting()  # type: ignore[attr-defined]


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": False}


def tools_of(choice: Any) -> Any:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    return parse_tools({"tools": [tool], "tool_choice": choice})


def test_a_required_call_is_held_to_harmonys_form_and_the_functions_schema(harmony_vocabulary: Any) -> None:
    _, ids = harmony_vocabulary
    spec = harmony_grammar(tools_of("required"), None, ids)
    assert spec is not None and f"<[{ids['<|constrain|>']}]>" in spec.source
    assert whole(harmony_vocabulary, spec, CALL_ANSWER)
    assert whole(harmony_vocabulary, spec, CALL_ANSWER.split("<|start|>assistant")[1])  # no reasoning first
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
    assert whole(harmony_vocabulary, spec, preamble + CALL_ANSWER.split("<|start|>assistant")[1])
    assert not whole(harmony_vocabulary, spec, CALL_ANSWER.replace("Paris", "Rome"))
    assert not whole(harmony_vocabulary, spec, TEXT_ANSWER)
    auto = harmony_grammar(tools_of("auto"), None, ids)
    assert auto is not None and whole(harmony_vocabulary, auto, TEXT_ANSWER) and whole(harmony_vocabulary, auto, CALL_ANSWER)


def test_a_json_schema_holds_the_final_channel_after_free_reasoning(harmony_vocabulary: Any) -> None:
    _, ids = harmony_vocabulary
    spec = harmony_grammar(None, GrammarSpec.json_schema(CITY, "response_format"), ids)
    assert spec is not None and spec.param == "response_format"
    reasoning = "<|channel|>analysis<|message|>Pick one.<|end|><|start|>assistant"
    assert whole(harmony_vocabulary, spec, reasoning + '<|channel|>final<|message|>{"city": "Oslo"}')
    assert not whole(harmony_vocabulary, spec, reasoning + "<|channel|>final<|message|>Oslo")
    assert harmony_grammar(None, None, ids) is None  # a free answer
    with pytest.raises(ApiError, match="structured_outputs.regex: gpt-oss reasons before it answers"):
        harmony_grammar(None, GrammarSpec("regex", "[a-z]+", "structured_outputs.regex"), ids)


async def test_a_json_schema_is_served_after_the_reasoning_and_another_grammar_is_refused_naming_its_field(serve: Any) -> None:
    client = await serve('<|channel|>analysis<|message|>Pick.<|end|><|start|>assistant<|channel|>final<|message|>{"city": "Oslo"}')
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    body = {"model": MODEL, "messages": CHAT["messages"], "response_format": schema}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    message = (await response.json())["choices"][0]["message"]
    assert json.loads(message["content"]) == {"city": "Oslo"} and message["reasoning_content"] == "Pick."
    body = {"model": MODEL, "messages": CHAT["messages"], "structured_outputs": {"regex": "[a-z]+"}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert "gpt-oss reasons before it answers" in error["message"] and error["param"].startswith("structured_outputs")


# An agent loop's second request: the call the model made, with its reasoning, and the result.
EARLIER = "Need the weather for Paris."
TURNS = {
    "/v1/chat/completions": {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": EARLIER, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], "tools": [WEATHER_TOOL]},
    "/v1/messages": {"max_tokens": 50, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": EARLIER, "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ], "tools": [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_TOOL["function"]["parameters"]}]},
    "/v1/responses": {"input": [
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": EARLIER}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ], "tools": [{"type": "function", **WEATHER_TOOL["function"]}]},
}


@pytest.mark.parametrize("path", sorted(TURNS))
async def test_the_reasoning_before_an_unanswered_call_reaches_the_prompt_as_its_analysis(path: str, compiler: GrammarCompiler) -> None:
    scheduler = harmony_scheduler(TEXT_ANSWER, compiler)
    seen: list[Any] = []
    encode_chat = scheduler.tokenizer.encode_chat

    def capture(messages: Any, *args: Any, tools: Any = None, **kwargs: Any) -> list[int]:
        seen.append(messages)
        return encode_chat(messages, *args, **kwargs)

    scheduler.tokenizer.encode_chat = capture  # type: ignore[method-assign]
    scheduler.tokenizer.knows_tools = True  # gpt-oss's template reads `tools`
    state = ServingState()
    state.ready(scheduler, (MODEL,))  # type: ignore[arg-type]
    async with TestClient(TestServer(create_app(DaemonConfig(), state, DaemonMetrics.create()))) as client:
        response = await client.post(path, json={"model": MODEL, **TURNS[path]})
        assert response.status == 200, await response.text()
    [messages] = seen
    [call_turn] = [m for m in messages if m.get("tool_calls")]
    assert call_turn["thinking"] == EARLIER
    prompt = render_within_budget(compile_chat_template(TEMPLATE), {"messages": messages, "tools": [WEATHER_TOOL], "add_generation_prompt": True})
    assert f"<|start|>assistant<|channel|>analysis<|message|>{EARLIER}<|end|><|start|>assistant to=functions.get_weather" in prompt


async def test_a_reasoning_field_that_is_not_text_is_refused_naming_it(serve: Any) -> None:
    client = await serve(TEXT_ANSWER)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": 5},
                {"role": "user", "content": "Bye"}]
    response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "messages[1].reasoning_content"
