"""The answers of `POST /tokenize` (`{"tokens": [...], "count": n, "max_model_len": m}`) and
`POST /detokenize` (`{"prompt": "..."}`), in vLLM's shapes."""

from __future__ import annotations

from typing import Any


def tokenize_body(tokens: list[int], max_context: int) -> dict[str, Any]:
    return {"tokens": tokens, "count": len(tokens), "max_model_len": max_context}


def detokenize_body(text: str) -> dict[str, Any]:
    return {"prompt": text}
