"""Tool calls read back from an answer as it streams: text passes through, calls come as
OpenAI streams them (a head with id and name, then the arguments in pieces), and the whole
calls match what a non-streaming read gives."""

from __future__ import annotations

import json

import pytest

from flare.api.tools.reader import ToolCallReader

ANSWER = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", "note": "a } and </tool_call>"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


@pytest.mark.parametrize("piece", [1, 3, 7, len(ANSWER)])
def test_streamed_deltas_rebuild_every_call_and_agree_with_the_whole_read(piece: int) -> None:
    reader = ToolCallReader(active=True)
    deltas = []
    for start in range(0, len(ANSWER), piece):
        text, new = reader.push(ANSWER[start : start + piece])
        assert text == ""
        deltas.extend(new)
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        entry = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
        if "id" in delta:
            assert delta["type"] == "function" and delta["function"]["arguments"] == "" and not entry["id"]
            entry["id"], entry["name"] = delta["id"], delta["function"]["name"]
        entry["arguments"] += delta["function"]["arguments"]
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Zürich", "note": "a } and </tool_call>"}
    assert calls[1]["arguments"] == "{}"
    assert [(c.id, c.name, c.arguments) for c in reader.calls] == [
        (calls[i]["id"], calls[i]["name"], calls[i]["arguments"]) for i in (0, 1)
    ]


def test_text_passes_through_and_an_inactive_reader_reads_nothing() -> None:
    reader = ToolCallReader(active=True)
    assert reader.push("") == ("", [])
    assert reader.push("Hello") == ("Hello", [])
    assert reader.push(" <tool_call>") == (" <tool_call>", [])
    assert not reader.called
    assert ToolCallReader(active=False).push("<tool_call>{") == ("<tool_call>{", [])
