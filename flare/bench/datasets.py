"""What the benchmark sends: the shipped prompt sets, or a JSONL file of the operator's.

Every entry is a `Conversation`: fixed messages sent as they are, then user turns sent one
after another, each with the history before it (the previous turns and the server's answers).
A single-turn prompt is a conversation of one turn. The shipped sets were written for flare
(or generated here from word lists written for it); nothing is downloaded.

- `chat`: varied short questions and requests, the answers free text
- `copy`: repeat, quote or lightly edit a paragraph given in the prompt (speculation's best case)
- `long-prompt`: reports of about 1,000 to 4,000 tokens followed by a question about them
- `multi-turn`: conversations of three or four turns, each resent with its history
- `FILE.jsonl`: one JSON object a line: `{"prompt": "..."}`, `{"messages": [...]}` (the last one
  from the user) or `{"turns": ["...", "..."], "system": "..."}`, each optionally with
  `"max_tokens"`
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Message = dict[str, str]


class DatasetError(ValueError):
    """A dataset name that is neither shipped nor a readable JSONL file, or a bad line in one."""


@dataclass(frozen=True)
class Conversation:
    """`history` goes first as it is; then each of `turns` is sent as a user message, the
    server's answer to it appended before the next. `max_tokens` overrides the run's setting."""

    turns: tuple[str, ...]
    history: tuple[Message, ...] = ()
    max_tokens: int | None = None


CHAT = (
    "What is the capital of France?",
    "Explain how a bicycle works, part by part, for a curious child.",
    "Write a short poem about the first snow of winter.",
    "Give me five tips for keeping a small vegetable garden healthy.",
    "What is the difference between weather and climate?",
    "Describe a walk through a busy market in a city you love.",
    "How do I boil an egg so that the yolk stays soft?",
    "Tell me about the history of the printing press and why it mattered.",
    "Write a polite email asking a neighbour to trim a hedge.",
    "Why is the sky blue? Keep it short.",
    "Suggest a name for a bakery that sells only bread made with rye.",
    "What should I pack for a three-day hike in the mountains?",
    "Explain what a prime number is and give three examples.",
    "Summarise the plot of a classic fairy tale in four sentences.",
    "How does a refrigerator keep food cold?",
    "Write a haiku about a cat asleep in the sun.",
    "What are the main causes of the seasons on Earth?",
    "Give me a simple recipe for tomato soup.",
    "Describe the life cycle of a butterfly.",
    "What is photosynthesis, in two sentences?",
    "List four ways to save energy at home.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "How many legs does a spider have, and how many does an insect have?",
    "Explain the rules of chess to a beginner.",
    "What makes a good cup of tea?",
    "Write a limerick about a forgetful robot.",
    "Why do leaves change colour in autumn?",
    "Give three reasons to learn a second language.",
    "What is the water cycle?",
    "Describe the sound of rain on a tin roof.",
    "How do airplanes stay in the air?",
    "Recommend three board games for a family evening and say why.",
    "What is the tallest mountain in the world, and where is it?",
    "Write a thank-you note to a teacher.",
    "Explain what a computer's memory is for.",
    "How can I fall asleep more easily?",
    "Tell me a fun fact about octopuses.",
    "Write a short dialogue between a fox and a crow.",
    "What are the planets of the solar system, in order?",
    "Give me a packing list for a beach holiday.",
)

PASSAGES = (
    "The old harbour town woke slowly. Fishermen untied their boats, gulls circled above the "
    "market, and the baker on the corner opened his shutters to the smell of fresh bread. By noon "
    "the square was full of travellers, merchants and children chasing each other between the stalls.",
    "Every spring the river rose over its banks and covered the lower fields with a thin layer of "
    "silt. The farmers waited for the water to fall, then ploughed the soft earth and sowed barley, "
    "which grew faster there than anywhere else in the valley.",
    "The library kept its rarest books in a cold room behind two locked doors. Visitors signed a "
    "ledger, washed their hands and turned the pages with a thin wooden spatula, while a clerk "
    "watched from a desk by the window and wrote down the time they left.",
    "To replace a bicycle tyre, first release the brake and remove the wheel. Push the tyre levers "
    "under the bead, pull the old tube out, check the inside of the tyre for thorns, then fit the "
    "new tube, inflate it a little and work the bead back over the rim.",
    "The committee met on the first Tuesday of each month. It reviewed the budget, heard reports from "
    "the garden, the kitchen and the repair shop, and voted on new requests. Minutes were posted on "
    "the notice board by Friday, and anyone could ask for a correction within a week.",
    "At dawn the train left the coast and climbed through pine forests towards the pass. The "
    "carriages were old and the windows rattled, but the view of the lakes below, still grey in the "
    "early light, made every passenger fall silent for a while.",
)

COPY_INSTRUCTIONS = (
    "Copy the following paragraph exactly, word for word:\n\n{passage}",
    "Repeat this text back to me without changing anything:\n\n{passage}",
    "Quote the following passage in full:\n\n{passage}",
    "Rewrite the paragraph below in the past perfect tense, changing nothing else:\n\n{passage}",
    "Rewrite the paragraph below, replacing every 'the' with 'that':\n\n{passage}",
)

MULTI_TURN = (
    ("I want to start running. How should I begin?",
     "How many times a week should I run in the first month?",
     "What should I eat before a morning run?",
     "Write me a four-week plan as a short list."),
    ("Tell me about the Moon's phases.",
     "Why do we always see the same side of the Moon?",
     "How long would it take to drive there at highway speed?"),
    ("I have flour, eggs, milk and apples. What can I bake?",
     "Give me the recipe for the second idea.",
     "How do I make it without eggs?"),
    ("Explain what a database index is.",
     "When does an index make writes slower?",
     "Give an example with a table of customers.",
     "Summarise our conversation in two sentences."),
    ("Write the first paragraph of a mystery story set in a lighthouse.",
     "Continue the story with a second paragraph.",
     "Now write the ending in three sentences."),
    ("What are the benefits of learning to play the piano as an adult?",
     "How much should I practise each day?",
     "Suggest three easy pieces to start with."),
    ("My tomato plants have yellow leaves. What could be wrong?",
     "How often should I water them?",
     "Is it too late to add compost in midsummer?"),
    ("Plan a day in a city by the sea for a family with two children.",
     "What if it rains all day?",
     "Make the rainy-day plan cheaper."),
)

# Word lists for the long-prompt reports: generated text of a known size, about 1.3 tokens a word.
_SUBJECTS = ("The northern depot", "The night shift", "Our supplier in the valley", "The maintenance team",
             "The finance office", "The second warehouse", "The delivery fleet", "The quality group",
             "The river crossing", "The new scheduling system", "The regional manager", "The east kitchen")
_VERBS = ("reported", "reduced", "doubled", "delayed", "inspected", "replaced", "measured", "recorded",
          "postponed", "approved", "cancelled", "completed")
_OBJECTS = ("the weekly orders", "three broken conveyor belts", "the spare parts budget", "its fuel use",
            "the morning deliveries", "two hundred crates of apples", "the cold-room temperatures",
            "the safety training", "every invoice from March", "the repair of the loading ramp",
            "the overtime hours", "the stock of packing paper")
_DETAILS = ("after the storm", "ahead of the holiday", "without extra staff", "for the third month running",
            "despite the late trucks", "at a lower cost than planned", "while the road was closed",
            "under the new rules", "before the audit", "on the advice of the engineers")
_QUESTIONS = ("Summarise the report above in three sentences.",
              "Which team is mentioned most often in the report above, and what did it do?",
              "List the three most important problems described in the report above.",
              "Write a one-paragraph memo to staff based on the report above.")
LONG_PROMPT_WORDS = (800, 1100, 1400, 1700, 2000, 2300, 2600, 3000)


def report(words: int, rng: random.Random) -> str:
    """An operations report of at least `words` words, drawn with `rng` (the long-prompt set's body)."""
    sections: list[str] = []
    count = 0
    section = 0
    while count < words:
        section += 1
        sentences = []
        for _ in range(rng.randint(5, 9)):
            sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_DETAILS)}."
            sentences.append(sentence)
            count += len(sentence.split())
        sections.append(f"Section {section}.\n" + " ".join(sentences))
    return "Operations report.\n\n" + "\n\n".join(sections)


def _long_prompts() -> tuple[Conversation, ...]:
    rng = random.Random(16)  # fixed: the set is the same on every machine and in every run
    return tuple(
        Conversation(turns=(f"{report(words, rng)}\n\n{_QUESTIONS[i % len(_QUESTIONS)]}",))
        for i, words in enumerate(LONG_PROMPT_WORDS)
    )


def _shipped(name: str) -> tuple[Conversation, ...]:
    if name == "chat":
        return tuple(Conversation(turns=(q,)) for q in CHAT)
    if name == "copy":
        return tuple(
            Conversation(turns=(instruction.format(passage=passage),))
            for instruction in COPY_INSTRUCTIONS
            for passage in PASSAGES
        )
    if name == "long-prompt":
        return _long_prompts()
    if name == "multi-turn":
        return tuple(Conversation(turns=turns) for turns in MULTI_TURN)
    raise KeyError(name)


SHIPPED = ("chat", "copy", "long-prompt", "multi-turn")


def load_dataset(name: str) -> tuple[Conversation, ...]:
    """A shipped set by name, or the conversations of a JSONL file."""
    if name in SHIPPED:
        return _shipped(name)
    path = Path(name)
    if not path.is_file():
        raise DatasetError(f"--dataset {name!r} is neither one of {', '.join(SHIPPED)} nor a JSONL file")
    conversations = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                conversations.append(_parse_line(line, f"{path}:{number}"))
    if not conversations:
        raise DatasetError(f"{path} holds no conversations (one JSON object a line)")
    return tuple(conversations)


def _parse_line(line: str, where: str) -> Conversation:
    try:
        entry = json.loads(line)
    except ValueError as error:
        raise DatasetError(f"{where}: not JSON ({error})") from None
    if not isinstance(entry, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    max_tokens = entry.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise DatasetError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
    kinds = [key for key in ("prompt", "messages", "turns") if key in entry]
    if len(kinds) != 1:
        raise DatasetError(f"{where}: give exactly one of 'prompt', 'messages' or 'turns'")
    if "prompt" in entry:
        return Conversation(turns=(_text(entry["prompt"], where, "prompt"),), max_tokens=max_tokens)
    if "turns" in entry:
        turns = entry["turns"]
        if not isinstance(turns, list) or not turns:
            raise DatasetError(f"{where}: 'turns' must be a non-empty list of strings")
        system = entry.get("system")
        history = ({"role": "system", "content": _text(system, where, "system")},) if system is not None else ()
        return Conversation(
            turns=tuple(_text(t, where, "turns") for t in turns), history=history, max_tokens=max_tokens
        )
    messages = entry["messages"]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list")
    parsed = [_message(m, where) for m in messages]
    if parsed[-1]["role"] != "user":
        raise DatasetError(f"{where}: the last message must be the user's (the one the server answers)")
    return Conversation(turns=(parsed[-1]["content"],), history=tuple(parsed[:-1]), max_tokens=max_tokens)


def _message(value: Any, where: str) -> Message:
    if not isinstance(value, dict) or value.get("role") not in ("system", "developer", "user", "assistant"):
        raise DatasetError(f"{where}: each message needs a role of system, developer, user or assistant")
    return {"role": value["role"], "content": _text(value.get("content"), where, "content")}


def _text(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise DatasetError(f"{where}: {field!r} must be a non-empty string")
    return value
