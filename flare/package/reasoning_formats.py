"""The ways a model writes its reasoning before its answer, as its chat template shows them.

A package's chat template decides the format once, when the package is loaded
(`reasoning_format`), as it decides the tool-call format (tool_formats.py): the answer's
reader (api/reasoning.py) sends the text between the marks to each API's reasoning field and
the text after the end mark as the answer.

- `think`: Qwen 3, QwQ and the DeepSeek-R1 distills: ``<think>...</think>`` opens the answer.
  A template that writes `<think>` itself at the end of the generation prompt (the R1
  distills') starts the answer inside the reasoning; one that writes a closed, empty pair there
  (Qwen 3 with `enable_thinking` false) starts it after.

- `harmony`: gpt-oss. Its reasoning is the message on the analysis channel,
  ``<|channel|>analysis<|message|>...<|end|>``, and its answer the final channel's message;
  the harmony reader (api/harmony.py) reads both, and the tool calls, from the channels.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str  # the mark that opens the reasoning
    end: str  # the mark that closes it; the answer follows
    # Whether the template reads `enable_thinking` (chat_template_kwargs), so a request can
    # switch the reasoning off in the prompt itself.
    switchable: bool = False


THINK = ReasoningFormat("think", "<think>", "</think>")
HARMONY = ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>")


def reasoning_format(source: str) -> ReasoningFormat | None:
    """The reasoning format the chat template `source` shows its model writing, or None for a
    model that answers at once: a template that writes or strips `</think>` knows the tags, one
    that writes harmony's channels (gpt-oss) reasons on the analysis channel."""
    if "<|channel|>analysis" in source:
        return HARMONY
    if THINK.end not in source:
        return None
    return ReasoningFormat(THINK.name, THINK.start, THINK.end, switchable="enable_thinking" in source)


def opens_inside(prompt_tail: str, fmt: ReasoningFormat) -> bool:
    """Whether a prompt ending with `prompt_tail` leaves the model inside its reasoning: the
    generation prompt opened the start mark and did not close it."""
    return prompt_tail.rstrip().endswith(fmt.start)
