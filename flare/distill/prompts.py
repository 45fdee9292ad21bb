"""The prompt set a draft head is distilled on: conversations written for flare, shipped with it.

Varied on purpose: explanations, lists, letters, poems and quizzes over 40 subjects, everyday
requests (plans, how-to, stories, descriptions) over 26 more, short factual questions, code and
multi-turn chats, so the target's own answers cover the kinds of text it serves (the first
version, templated prompts only, drafted markedly worse on chat it had not seen:
docs/speculative.md). None of them is a prompt of `flare bench`'s shipped sets (benchmarks measure
the head on prompts it was not trained on). Every tenth conversation is held out: the
acceptance reported at export is measured on those.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

PROMPT_SET_NAME = "flare-distill-v2"

SUBJECTS = (
    "volcanoes", "the Roman empire", "honeybees", "solar panels", "sourdough bread", "black holes",
    "the human heart", "glaciers", "electric cars", "coral reefs", "the French revolution",
    "compound interest", "vaccines", "the internet", "rainforests", "chess openings", "earthquakes",
    "coffee", "the Silk Road", "recycling plastic", "jazz music", "the immune system", "tides",
    "wind turbines", "ancient Egypt", "sleep", "penguins", "3D printing", "the stock market",
    "bread yeast", "migrating birds", "the printing of money", "deserts", "microwave ovens",
    "the Olympic games", "mushrooms", "satellites", "the piano", "deep sea fish", "bamboo",
)

SINGLE_TURN = (
    "Explain {s} to a twelve-year-old.",
    "Write three short paragraphs about {s}.",
    "Give me a numbered list of seven facts about {s}.",
    "What are the most common misconceptions about {s}?",
    "Write a short blog post introduction about {s}.",
    "Summarise the history of {s} in five bullet points.",
    "What are the pros and cons of {s}? Answer as two lists.",
    "Write a friendly email to a colleague recommending a book about {s}.",
    "Compose a short poem about {s}.",
    "Write a quiz of four questions about {s}, with answers.",
)

CODE = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a SQL query that counts orders per customer in a table orders(customer_id, total).",
    "Write a JavaScript function that removes duplicate values from an array.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Explain what this Python code does: `sorted(words, key=len, reverse=True)[:3]`",
    "Write a bash one-liner that counts the lines of every .py file in a directory.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python script that reads a CSV file and prints the average of its second column.",
    "Write a function in C that reverses a string in place.",
    "Write a Python generator that yields prime numbers.",
    "Show how to read a JSON file in Python and print one of its keys.",
)

# Everyday requests over everyday things, phrased as people ask them.
EVERYDAY_SUBJECTS = (
    "a lemon cake", "a vegetable curry", "pancakes", "a leaking tap", "a flat bicycle tyre", "a job interview",
    "a birthday party", "a rainy weekend", "a small balcony garden", "a first marathon", "a long flight",
    "a new puppy", "a houseplant with brown leaves", "a noisy neighbour", "a tight budget", "a camping trip",
    "learning to swim", "a wedding speech", "a slow laptop", "a move to a new city", "a science fair project",
    "a rainy-day game for children", "a picnic", "a sore back", "a team meeting", "a school reunion",
)
EVERYDAY = (
    "How do I deal with {s}?",
    "Give me a step-by-step plan for {s}.",
    "What should I know before {s}? Keep it short.",
    "Write a short story that involves {s}.",
    "Describe {s} in a few vivid sentences.",
    "My friend asked me about {s}. What should I tell them?",
    "List the things I need for {s}.",
    "Write a haiku and a limerick about {s}.",
)
QUESTIONS = (
    "Why do cats purr?", "How far away is the Sun?", "What causes thunder?", "Who invented the telephone?",
    "How do vaccines train the body?", "Why is the ocean salty?", "What is a black hole made of?",
    "How many bones are in the human body?", "Why do we dream?", "How does a compass work?",
    "What is the difference between a virus and a bacterium?", "How do bees make honey?",
    "What is inflation, in simple words?", "Why do onions make people cry?", "How does a rainbow form?",
    "What is the speed of light?", "Why do birds fly south in winter?", "How is glass made?",
    "What does a civil engineer do?", "How do submarines dive and surface?", "What is a haiku?",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    "How long does it take to boil pasta?", "What is the largest animal that ever lived?",
)

MULTI_TURN = (
    ("Tell me about {s}.", "Can you give a concrete example?", "Summarise that in one sentence."),
    ("I am writing a school report on {s}. Where should I start?", "Suggest an outline with four sections."),
    ("What is the most surprising thing about {s}?", "Why is that?"),
)

SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class DistillPrompt:
    """Messages before the assistant's answer (a multi-turn prompt carries short earlier answers,
    written for it, that the target continues from; the target answers only the last turn)."""

    messages: tuple[dict[str, str], ...]
    held_out: bool


def distill_prompts() -> list[DistillPrompt]:
    """The shipped set, in a fixed order."""
    conversations: list[tuple[dict[str, str], ...]] = []
    for i, subject in enumerate(SUBJECTS):
        for j, template in enumerate(SINGLE_TURN):
            if (i + j) % 2 == 0:  # half of the products: 200 single-turn prompts over 40 subjects
                conversations.append(_single(template.format(s=subject)))
        turns = MULTI_TURN[i % len(MULTI_TURN)]
        conversations.append(_multi([t.format(s=subject) for t in turns]))
    for task in CODE:
        conversations.append(_single(task))
    for i, subject in enumerate(EVERYDAY_SUBJECTS):
        for j, template in enumerate(EVERYDAY):
            if (i + j) % 2 == 0:
                conversations.append(_single(template.format(s=subject)))
    for question in QUESTIONS:
        conversations.append(_single(question))
    return [DistillPrompt(messages, held_out=index % 10 == 9) for index, messages in enumerate(conversations)]


def prompt_set_digest() -> str:
    """A short hash of the set, recorded in the manifest next to its name."""
    text = json.dumps([p.messages for p in distill_prompts()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _single(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "system", "content": SYSTEM}, {"role": "user", "content": text})


def _multi(turns: list[str]) -> tuple[dict[str, str], ...]:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in turns[:-1]:
        messages.append({"role": "user", "content": turn})
        messages.append({"role": "assistant", "content": "Sure. Here is a short answer."})
    messages.append({"role": "user", "content": turns[-1]})
    return tuple(messages)
