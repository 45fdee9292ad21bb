"""A request's `input` as the items a stored response keeps and `input_items` lists: OpenAI's
item shapes, each with an id (a message's string content as one text part).

Called once the request is parsed, so every item here has been checked.
"""

from __future__ import annotations

from typing import Any

from flare.api.rendering import new_id

# OpenAI's item ids: msg_... (a message), fc_... (a function call), fco_... (its output),
# rs_... (reasoning).
_ITEM_IDS = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    return [_item(item) for item in given]


def _item(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    rest = {k: v for k, v in item.items() if k not in ("type", "id")}
    kept = {"type": kind, "id": item.get("id") or new_id(_ITEM_IDS[kind]), **rest}
    if kind == "message" and isinstance(kept.get("content"), str):
        part = "output_text" if kept.get("role") == "assistant" else "input_text"
        kept["content"] = [{"type": part, "text": kept["content"]}]
    return kept
