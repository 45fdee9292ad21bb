"""A choice's reasoning read apart from its answer as it streams, in the package's reasoning
format (package/reasoning_formats.py).

The text between the start and end marks is reasoning; what follows the end mark (less the
newlines the model writes after it) is the answer, which the tool-call reader then reads.
Text that may still become a mark is held back until it is known, so neither side ever shows
part of a mark.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from flare.package.reasoning_formats import ReasoningFormat
from flare.structured.compiler import JSON_OPTIONS
from flare.structured.spec import GrammarSpec


def _held(buffer: str, mark: str) -> int:
    """How many characters at the end of `buffer` may be the start of `mark`."""
    return next((n for n in range(min(len(mark) - 1, len(buffer)), 0, -1) if buffer.endswith(mark[:n])), 0)


@dataclass
class ReasoningReader:
    """Splits one choice's text into (reasoning, answer) pieces. `inside`: the prompt opened
    the reasoning, so the answer starts inside it."""

    fmt: ReasoningFormat
    inside: bool = False
    _mode: Literal["before", "reasoning", "after", "answer"] = "before"
    _buffer: str = ""

    def __post_init__(self) -> None:
        if self.inside:
            self._mode = "reasoning"

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of this piece of text."""
        self._buffer += text
        reasoning = ""
        if self._mode == "before":
            opening = self._buffer.lstrip()
            if not opening or (self.fmt.start.startswith(opening) and opening != self.fmt.start):
                return "", ""  # nothing yet, or what may still become the start mark
            if not opening.startswith(self.fmt.start):
                self._mode = "answer"
            else:
                self._mode = "reasoning"
                self._buffer = opening[len(self.fmt.start) :]
        if self._mode == "reasoning":
            end = self._buffer.find(self.fmt.end)
            if end < 0:
                held = _held(self._buffer, self.fmt.end)
                cut = len(self._buffer) - held
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(self.fmt.end) :]
            self._mode = "after"
        if self._mode == "after":
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer:
                return reasoning, ""
            self._mode = "answer"
        answer, self._buffer = self._buffer, ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """What is held back when the choice ends: a partial mark is text after all."""
        held, self._buffer = self._buffer, ""
        if self._mode == "reasoning":
            return held, ""
        return "", held if self._mode != "after" else ""


def reasoning_regex(opening: str, closing: str) -> str:
    """A regular expression (Lark's, slashes escaped) of `opening`, text without `closing`,
    `closing` and newlines: one lexeme, so that the reasoning ends at its first closing mark."""

    def escaped(text: str) -> str:
        return re.escape(text).replace("/", "\\/")

    # Text without `closing`: each character but the mark's first, or a proper prefix of the
    # mark followed by a character that does not continue it.
    avoid = "|".join(f"{escaped(closing[:n])}[^{escaped(closing[n])}]" for n in range(len(closing)))
    return f"{escaped(opening)}({avoid})*{escaped(closing)}\\n*"


def reasoning_rule(fmt: ReasoningFormat, inside: bool) -> tuple[str, str]:
    """(what a grammar's start rule opens with, the REASONING terminal's line): the reasoning,
    required when the prompt opened it (without its start mark), optional otherwise."""
    opening, optional = ("", "") if inside else (fmt.start, "?")
    return f"REASONING{optional} ", f"REASONING: /{reasoning_regex(opening, fmt.end)}/\n"


def after_reasoning(spec: GrammarSpec, fmt: ReasoningFormat, inside: bool) -> GrammarSpec:
    """A JSON schema's grammar that holds the answer after the reasoning and leaves the reasoning
    free: the reasoning (required when the prompt opened it, else optional), then the JSON."""
    schema = {"x-guidance": JSON_OPTIONS, **json.loads(spec.source)}  # as a json_schema compiles
    opens, terminal = reasoning_rule(fmt, inside)
    return GrammarSpec("lark", f"start: {opens}%json {json.dumps(schema)}\n{terminal}", spec.param, spec.closed_objects)
