"""GPT-2's byte-level alphabet: the printable character each byte is written as in the vocabulary
of a byte-level BPE tokenizer.json (the printable Latin-1 bytes as themselves, the others as the
characters from U+0100 on, in byte order)."""

from __future__ import annotations


def _alphabet() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


BYTE_LEVEL_ALPHABET: dict[int, str] = _alphabet()  # byte -> its character
BYTE_OF_CHARACTER: dict[str, int] = {c: b for b, c in BYTE_LEVEL_ALPHABET.items()}
