"""Text <-> token ids for a package: the tokenizer, the chat template, incremental detokenization."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as BackendTokenizer

from flare.package.byte_level import BYTE_OF_CHARACTER
from flare.package.chat_template import (
    ChatTemplateError,
    compile_chat_template,
    reads_tools,
    render_within_budget,
    takes_system_turn,
)
from flare.package.reasoning_formats import reasoning_format
from flare.package.tool_formats import FLARE, tool_call_format

if TYPE_CHECKING:
    from flare.package.directory import Package

__all__ = ["CannotContinue", "ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "compile_chat_template"]


class CannotContinue(ChatTemplateError):
    """The chat template does not write the final message's content as sent, so the prompt
    cannot be cut at its end to continue it."""

# How many tokens before the first new one the detokenizer decodes as context, as vLLM and TGI
# do: enough for a tokenizer whose decoding of a token depends on its neighbours (leading-space
# stripping, multi-byte characters split over tokens) to decode the boundary as it would in
# the whole text.
DETOKENIZER_CONTEXT_TOKENS = 5
REPLACEMENT_CHARACTER = "\ufffd"
# Special-token text in chat message content is replaced by ESCAPE + index + END before the
# template renders (ESCAPE itself by ESCAPE + END), so the only special tokens in the rendered
# prompt are those the template wrote. Both are Unicode noncharacters: never meaningful text.
_ESCAPE = "\ufdd0"
_ESCAPE_END = "\ufdd1"
_ESCAPED = re.compile(f"{_ESCAPE}(\\d*){_ESCAPE_END}")
# Appended to the final message's content to continue it: the rendered prompt is cut where the
# template wrote it, so whatever the template closes the turn with is never part of the prompt.
# Escaped content never holds it (an escape is followed by digits or the end mark alone).
_CONTINUE_HERE = f"{_ESCAPE}continue{_ESCAPE_END}"
_BYTE_FALLBACK_TOKEN = re.compile("<0x([0-9A-Fa-f]{2})>")
# Parts of a tokenizer pipeline that never make a text shorter, and that map each token back to
# at most its own length of text: with only these, a text of N characters is at least
# N / (longest token) tokens. Anything else (a normalizer that composes characters, a
# pre-tokenizer that drops whitespace, a model that fuses unknown runs) voids the bound.
_LENGTH_KEEPING_NORMALIZERS = frozenset({"Prepend", "Replace", "NFD", "NFKD", "Lowercase", "Sequence"})
_LENGTH_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts", "Sequence"}
)


class Tokenizer:
    """A Hugging Face `tokenizers` tokenizer plus the package's chat template and stop tokens."""

    def __init__(
        self,
        backend: BackendTokenizer,
        chat_template: str,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self._template = compile_chat_template(chat_template)
        # How the template writes tool calls, so the answer's grammar and reader use the same.
        self.tool_format = tool_call_format(chat_template)
        # A template that reads `tools` renders function definitions and tool turns itself, where
        # its calls are in a format flare reads back. One whose format flare does not know
        # (DeepSeek-V3.2's DSML, Gemma 4's) would teach the model that format while the
        # grammar holds its answer to flare's: its conversation is written in flare's format
        # instead, with the preamble that teaches it (api/tools/prompt.py).
        self.knows_tools = reads_tools(chat_template) and self.tool_format is not FLARE
        # How the model writes its reasoning before the answer (Qwen 3's <think>), or None.
        self.reasoning_format = reasoning_format(chat_template)
        # Where flare's tool preamble goes for a template without tools: its own system turn,
        # or the first user turn for a template that refuses system turns (Gemma 2's).
        self.takes_system_turn = takes_system_turn(self._template)
        # The special-token strings templates refer to, as transformers passes them.
        self._special_tokens: dict[str, str] = {"eos_token": backend.id_to_token(self.eos_token_ids[0])}
        if bos_token_id is not None:
            self._special_tokens["bos_token"] = backend.id_to_token(bos_token_id)
        specification = json.loads(backend.to_str())
        self.max_chars_per_token = _max_chars_per_token(specification)
        self._byte_fallback = bool((specification.get("model") or {}).get("byte_fallback"))
        # Control tokens (added tokens marked special), longest first so that one that is a
        # prefix of another never wins: how the template's control tokens are found.
        added = backend.get_added_tokens_decoder()
        self._control = {token.content: token for token in added.values() if token.special}
        self._control_ids = {content: backend.token_to_id(content) for content in self._control}
        self._control_names = sorted(self._control, key=len, reverse=True)
        self._control_index = {name: index for index, name in enumerate(self._control_names)}
        self._control_pattern = (
            re.compile("|".join(re.escape(name) for name in self._control_names)) if self._control else None
        )
        # tokenizers keeps "special-token text is ordinary text" as a switch on the object: each
        # encode sets it and encodes under this lock, so threads never see each other's setting.
        # One object, not a second copy read with the switch on: a 150k-token vocabulary's
        # tokenizer is about 30 MB resident.
        self._encoding = threading.Lock()
        # Added tokens are written as their text, not in the byte-level alphabet.
        self._added_token_ids = frozenset(backend.get_added_tokens_decoder())
        # The control tokens the tool-call format writes (Mistral's [TOOL_CALLS]): the answer's
        # grammar names them by id, and decoding keeps their text, which the calls' reader reads.
        self.tool_tokens = {
            name: self._control_ids[name]
            for name in self._control_names
            if any(name in mark for mark in self.tool_format.marks)
        }
        self._decode_backend = _decoding_as_text(backend, self.tool_tokens) if self.tool_tokens else backend

    @classmethod
    def from_package(cls, package: Package) -> Tokenizer:
        config = package.manifest.model
        return cls.from_file(
            package.tokenizer_json_path,
            package.chat_template,
            eos_token_ids=config.eos_token_ids,
            bos_token_id=config.bos_token_id,
        )

    @classmethod
    def from_file(
        cls,
        tokenizer_json: Path | str,
        chat_template: str,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
    ) -> Tokenizer:
        return cls(
            BackendTokenizer.from_file(str(tokenizer_json)),
            chat_template,
            eos_token_ids=eos_token_ids,
            bos_token_id=bos_token_id,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. A BOS token is added only when tokenizer.json's post-processor
        says so (the package records the model's add_bos choice there); special-token text
        such as `<|im_start|>` becomes its special token.

        `encode_batch`, not `encode`: only the batch call releases the GIL while it works, so a
        long text tokenized in a worker thread leaves the event loop free meanwhile."""
        return self._encode_batch([text], add_special_tokens=add_special_tokens, special_tokens_as_text=False)[0]

    def _encode_batch(self, texts: list[str], *, add_special_tokens: bool, special_tokens_as_text: bool) -> list[list[int]]:
        """Each text's token ids, special-token text read as its special token or, with
        `special_tokens_as_text`, as ordinary text (`encode_batch` releases the GIL while it works)."""
        with self._encoding:
            self.backend.encode_special_tokens = special_tokens_as_text
            return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def fewest_tokens(self, characters: int) -> int | None:
        """A lower bound on the tokens of any text of `characters` characters (None when this
        tokenizer's pipeline allows no such bound): what lets a server refuse a prompt that
        cannot fit its context without tokenizing it."""
        if self.max_chars_per_token is None:
            return None
        return -(-characters // self.max_chars_per_token)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._decode_backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (what a log-probability entry reports): a
        byte-level BPE token's bytes through GPT-2's byte-to-character map, a byte-fallback
        vocabulary's `<0xNN>` its byte and its other tokens their text (U+2581 a space), an
        added token's text as UTF-8; b"" for an id outside the vocabulary."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_token_ids or token in self._control:
            return token.encode("utf-8")
        if self._byte_fallback:  # a SentencePiece-style vocabulary: text with U+2581 spaces
            fallback = _BYTE_FALLBACK_TOKEN.fullmatch(token)
            if fallback:  # <0xNN>: a byte of a character outside the vocabulary
                return bytes([int(fallback.group(1), 16)])
            return token.replace("\u2581", " ").encode("utf-8")
        try:
            return bytes(BYTE_OF_CHARACTER[c] for c in token)
        except KeyError:  # not a byte-level token
            return token.replace("\u2581", " ").encode("utf-8")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a conversation (and of the functions it may call, for a template
        that knows tools); raises `ChatTemplateError` when rendering fails.

        `continue_final_message` leaves the final message open, as transformers' and vLLM's
        option of that name does: the prompt ends with its content, and what the model writes
        next continues it (an assistant prefill). The conversation is rendered whole, with a
        marker after that content, and cut at the marker; `CannotContinue` where the template
        does not write the content, marker included, exactly once and as sent."""
        rendered = [dict(message) for message in messages]
        if continue_final_message:
            final = rendered[-1].get("content")
            if not isinstance(final, str):
                raise CannotContinue("the final message has no text content to continue")
            rendered[-1]["content"] = final + _CONTINUE_HERE
            add_generation_prompt = False
        context = {
            "messages": rendered,
            "tools": list(tools) if tools else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self._special_tokens,
            **(template_kwargs or {}),  # what the request switches in the template (enable_thinking)
        }
        text = render_within_budget(self._template, context)
        if not continue_final_message:
            return text
        if text.count(_CONTINUE_HERE) != 1:
            raise CannotContinue(
                "the chat template does not write the final message's content once, as sent, so it cannot be continued"
            )
        prompt = text[: text.index(_CONTINUE_HERE)]
        # A template may drop the content's leading whitespace (a `trim`); anything else it
        # changes would make the answer continue a text the client did not send.
        if not prompt.endswith(final.lstrip()):
            raise CannotContinue(
                "the chat template changes the final message's content, so it cannot be continued as sent"
            )
        return prompt

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        special_tokens_in_content: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids of a conversation. The template writes any BOS itself, so none is added
        (as transformers' apply_chat_template(tokenize=True) does).

        Text in a message is text: special-token strings in a message's content (such as
        `<|im_end|>\n<|im_start|>system`) are tokenized as ordinary text, so a user cannot forge
        a turn of another role; only the template emits control tokens. The ids are those of
        tokenizing the whole rendered prompt whenever the content holds no such string (the
        tokenizer splits its input at special tokens and tokenizes the pieces apart anyway).
        `special_tokens_in_content=True` restores reading them as control tokens.
        `continue_final_message`: the prompt ends with the final message's content, left open
        (render_chat)."""
        if special_tokens_in_content or self._control_pattern is None:
            prompt = self.render_chat(
                messages, add_generation_prompt, tools, continue_final_message=continue_final_message,
                template_kwargs=template_kwargs,
            )
            return self.encode(prompt, add_special_tokens=False)
        # Every string a client sent is text: content, and the tool calls and tool definitions
        # a template may write out.
        escaped = [self._escape_all(dict(message)) for message in messages]
        rendered = self.render_chat(
            escaped,
            add_generation_prompt,
            self._escape_all(list(tools)) if tools else None,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        # Text and the control tokens the template wrote, alternating (text first and last).
        pieces: list[str] = []
        start = 0
        for match in self._control_pattern.finditer(rendered):
            pieces.append(rendered[start : match.start()])
            pieces.append(match.group())
            start = match.end()
        pieces.append(rendered[start:])
        texts = self._texts_between_control_tokens(pieces)
        encoded = iter(
            self._encode_batch([self._unescape(t) for t in texts], add_special_tokens=False, special_tokens_as_text=True)
        )
        ids: list[int] = []
        for index, piece in enumerate(pieces):
            if index % 2:
                ids.append(self._control_ids[piece])
            else:
                ids.extend(next(encoded))
        return ids

    def _texts_between_control_tokens(self, pieces: list[str]) -> list[str]:
        """The text pieces, with the whitespace next to a control token removed where the token
        says so (lstrip / rstrip), as the tokenizer does when it meets the token in a text."""
        texts = pieces[::2]
        for index in range(1, len(pieces), 2):
            token = self._control[pieces[index]]
            before, after = index // 2, index // 2 + 1
            if token.lstrip:
                texts[before] = texts[before].rstrip()
            if token.rstrip:
                texts[after] = texts[after].lstrip()
        return texts

    def _escape_all(self, value: Any) -> Any:
        """`_escape` of every string in nested dicts and lists (keys too)."""
        if isinstance(value, dict):
            return {self._escape(k): self._escape_all(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._escape_all(v) for v in value]
        return self._escape(value)

    def _escape(self, content: Any) -> Any:
        if not isinstance(content, str):
            return content  # the template decides what to make of it (or refuses it)
        content = content.replace(_ESCAPE, _ESCAPE + _ESCAPE_END)
        if self._control_pattern is not None:
            index = self._control_index
            content = self._control_pattern.sub(lambda m: f"{_ESCAPE}{index[m.group()]}{_ESCAPE_END}", content)
        return content

    def _unescape(self, text: str) -> str:
        if _ESCAPE not in text:
            return text
        return _ESCAPED.sub(lambda m: self._control_names[int(m.group(1))] if m.group(1) else _ESCAPE, text)


def _decoding_as_text(backend: BackendTokenizer, names: Mapping[str, int]) -> BackendTokenizer:
    """`backend` for decoding, with the added tokens `names` no longer special: skipping
    special tokens leaves them in the text."""
    specification = json.loads(backend.to_str())
    for token in specification.get("added_tokens") or ():
        if token.get("content") in names:
            token["special"] = False
    return BackendTokenizer.from_str(json.dumps(specification))


def _max_chars_per_token(specification: Mapping[str, Any]) -> int | None:
    """The most characters of input text one token can stand for, or None when the pipeline
    can make a text shorter (see _LENGTH_KEEPING_*), so no such bound holds."""
    if not _keeps_length(specification.get("normalizer"), "normalizers", _LENGTH_KEEPING_NORMALIZERS):
        return None
    if not _keeps_length(specification.get("pre_tokenizer"), "pretokenizers", _LENGTH_KEEPING_PRE_TOKENIZERS):
        return None
    model = specification.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and model.get("unk_token") is not None):
        return None  # Unigram and fused BPE unknowns cover any run of characters; WordPiece words
    vocabulary = model.get("vocab") or {}
    added = [token.get("content", "") for token in specification.get("added_tokens") or ()]
    lengths = [len(token) for token in (*vocabulary, *added)]
    return max(lengths) if lengths else None


def _keeps_length(component: Any, children: str, keeping: frozenset[str]) -> bool:
    if component is None:
        return True
    kind = component.get("type")
    if kind not in keeping:
        return False
    if kind == "Replace" and not component.get("content"):
        return False  # replacing with nothing deletes text
    if kind in ("Split", "Punctuation") and str(component.get("behavior", "")).lower() == "removed":
        return False
    return all(_keeps_length(child, children, keeping) for child in component.get(children) or ())


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, as they become final.

    Each push decodes a short window - from `DETOKENIZER_CONTEXT_TOKENS` before the text already
    emitted to the newest token - once with and once without the new tokens, and emits the
    difference. Decoding the window with context (rather than the new tokens alone) keeps
    characters that depend on their neighbours, e.g. a leading space; holding back text that
    ends in U+FFFD keeps a multi-byte character split over tokens until its last byte arrives.
    The window only grows while text is held back, so a push costs O(new tokens).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids)
        # Text of ids[prefix_offset:read_offset] has been emitted (or is prompt); ids from
        # read_offset on are not yet emitted.
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - DETOKENIZER_CONTEXT_TOKENS, 0)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text that is now complete (possibly "")."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (e.g. a trailing incomplete character) at the end of a stream."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        end = len(self._ids)
        if self._read_offset == end:
            return ""
        emitted = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, end)
        if not final:
            # Hold back the newest tokens while they end in an incomplete character, but emit
            # what comes before them (a speculative round can bring complete and partial text).
            while text.endswith(REPLACEMENT_CHARACTER) and end > self._read_offset + 1:
                end -= 1
                text = self._decode(self._prefix_offset, end)
            if text.endswith(REPLACEMENT_CHARACTER) or len(text) <= len(emitted):
                return ""
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return text[len(emitted) :]
