"""The ways a model writes its tool calls, as its chat template teaches them.

A package's chat template decides the format once, when the package is loaded
(`tool_call_format`); the answer's grammar (api/tools/grammar.py) writes that format and the
reader parses it back into OpenAI `tool_calls`:

- `flare`: flare's own, for a template that does not know tools (the default model's):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per line (api/tools/prompt.py
  writes the preamble that teaches it).
- `qwen`: Qwen 2.5 / Qwen 3 and Hermes 2 Pro templates: the same tags, each call's JSON on a line
  of its own between them, as their templates write earlier calls. (Reasoning that opens the
  answer, Qwen 3's `<think>...</think>`, is the reasoning format's: reasoning_formats.py.)
- `llama3`: Llama 3.1 / 3.2: the bare JSON object ``{"name": ..., "parameters": {...}}``; one call
  per turn (their templates refuse a turn with several calls).
- `mistral`: Mistral v0.3 and later: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
  call ids of nine letters and digits (the template refuses any other).
- `kimi`: Kimi K2 and K2-Thinking: a section of calls, each with the function's name outside its
  arguments, ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``
  (the number counts the conversation's calls; the template writes its own, so the reader skips
  it). Its marks are control tokens of Kimi's vocabulary (`NameOutside`).
- `harmony`: gpt-oss. Its whole answer is messages on channels (analysis, commentary, final),
  and a call is a commentary message addressed to the function,
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``: not a
  JSON object among text, so it has none of the marks below, and its own reader
  (api/harmony.py) reads the answer. Its control tokens are `control_marks`, so decoding keeps
  their text for that reader.

Every answer of calls is `prefix`, then each call as `call_open` + JSON + `call_close` joined by
`separator`, then `suffix`; where the name is outside the JSON (`name_outside`), a call's JSON is
its arguments, after the header that names the function. A mark the vocabulary holds as a control token (Mistral's
`[TOOL_CALLS]`) is that token in the grammar, and stays in the decoded text for the reader. An answer that is text must not start with the character an answer
of calls starts with (`lead`; the grammar enforces it), so the reader tells text from calls at once.
"""

from __future__ import annotations

import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Literal

from flare.package.chat_template import reads_tools

ToolFormatName = Literal["flare", "qwen", "llama3", "mistral", "kimi", "harmony"]
_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class NameOutside:
    """A call that writes its function's name before its arguments, outside their JSON object:
    `call_open`, `before` NAME `after`, a call number where `numbered`, `arguments_open`, then the
    arguments' JSON object itself."""

    before: str
    after: str
    numbered: bool
    arguments_open: str

    @property
    def header(self) -> re.Pattern[str]:
        """A call's text up to its arguments, the name its group 1 (function names are
        api/tools/parse.py's: letters, digits, _ and -)."""
        number = r"[0-9]+" if self.numbered else ""
        return re.compile(
            re.escape(self.before) + r"([A-Za-z0-9_-]+)" + re.escape(self.after) + number + re.escape(self.arguments_open)
        )


@dataclass(frozen=True)
class ToolFormat:
    name: ToolFormatName
    prefix: str  # before the first call
    call_open: str  # before each call's JSON object
    call_close: str  # after each call's JSON object
    separator: str  # between two calls
    suffix: str  # after the last call
    arguments_key: str  # the key of the call object that holds the arguments
    several: bool  # whether the template takes more than one call in a turn
    id_style: Literal["openai", "nine_alphanumeric"] = "openai"
    control_marks: tuple[str, ...] = ()  # control tokens the answer is written with beyond the marks above
    name_outside: NameOutside | None = None  # None: the name is inside the call's JSON object

    @property
    def lead(self) -> str:
        """The character every answer of calls starts with (an answer of text never does)."""
        return (self.prefix + self.call_open + "{")[0]  # a bare call opens with its JSON object

    @property
    def head(self) -> re.Pattern[str]:
        """A call's JSON up to its arguments, as the grammar writes it (fixed separators)."""
        return re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "' + re.escape(self.arguments_key) + '": ')

    @property
    def marks(self) -> tuple[str, ...]:
        """The fixed texts the format writes around its calls."""
        named = (self.name_outside.arguments_open,) if self.name_outside else ()
        fixed = (self.prefix, self.call_open, self.call_close, self.separator, self.suffix, *named, *self.control_marks)
        return tuple(m for m in fixed if m)

    def new_call_id(self, prefix: str = "call_") -> str:
        """A new call's id: the API's form (`prefix` and hex), unless the template demands its own."""
        if self.id_style == "nine_alphanumeric":
            return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
        return f"{prefix}{uuid.uuid4().hex[:24]}"


FLARE = ToolFormat("flare", "", "<tool_call>", "</tool_call>", "\n", "", "arguments", several=True)
QWEN = ToolFormat("qwen", "", "<tool_call>\n", "\n</tool_call>", "\n", "", "arguments", several=True)
LLAMA3 = ToolFormat("llama3", "", "", "", "", "", "parameters", several=False)
MISTRAL = ToolFormat(
    "mistral", "[TOOL_CALLS] [", "", "", ", ", "]", "arguments", several=True, id_style="nine_alphanumeric"
)
KIMI = ToolFormat(
    "kimi", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_end|>", "", "<|tool_calls_section_end|>",
    "arguments", several=True,
    name_outside=NameOutside("functions.", ":", numbered=True, arguments_open="<|tool_call_argument_begin|>"),
)

# gpt-oss's control tokens (o200k_harmony): a message is <|start|>header<|message|>body, ended by
# <|end|>, or by <|call|> (a call) or <|return|> (the answer), which also end the generation.
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
HARMONY = ToolFormat("harmony", "", "", "", "", "", "arguments", several=False, control_marks=HARMONY_TOKENS)


def tool_call_format(source: str) -> ToolFormat:
    """The tool-call format the chat template `source` teaches: decided from the template's
    text, once, when a package is loaded.

    A template that does not read `tools` cannot show the model its functions: flare writes its
    own format then ("flare"), unless it writes harmony's channels (gpt-oss), whose answer is
    read as harmony whether or not it calls. Otherwise the marks each family's template writes its earlier
    calls with: Mistral's `[TOOL_CALLS]`, Kimi K2's call sections, the `<tool_call>` tags of Qwen
    and Hermes, Llama 3.1's `"parameters"` object beside its header tokens; any other such
    template (DeepSeek-V3.2's DSML, Gemma 4's), flare's format, and the conversation is written in it with
    flare's preamble rather than by the template (`Tokenizer.knows_tools`), so that the prompt
    teaches the format the answer is held to."""
    if "<|channel|>" in source:
        return HARMONY
    if not reads_tools(source):
        return FLARE
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|tool_calls_section_begin|>" in source:
        return KIMI
    if "<tool_call>" in source:
        return QWEN
    if '"parameters"' in source and "<|start_header_id|>" in source:
        return LLAMA3
    return FLARE
