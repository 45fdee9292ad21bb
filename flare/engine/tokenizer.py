"""Text <-> token ids for a package: the tokenizer, the chat template, incremental detokenization."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

if TYPE_CHECKING:
    from flare.preparation.package import Package

# How many tokens before the first new one the detokenizer decodes as context, as vLLM and TGI
# do: enough for a tokenizer whose decoding of a token depends on its neighbours (leading-space
# stripping, multi-byte characters split over tokens) to decode the boundary as it would in
# the whole text.
DETOKENIZER_CONTEXT_TOKENS = 5
REPLACEMENT_CHARACTER = "\ufffd"


class ChatTemplateError(ValueError):
    """The chat template failed to render these messages (a template bug or a message it refuses)."""


def _raise_exception(message: str) -> None:
    # Templates call raise_exception("...") to refuse a conversation (e.g. roles out of order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON (as transformers renders).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox, with the environment transformers renders it in."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template does not compile: {error}") from error


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
        # The special-token strings templates refer to, as transformers passes them.
        self._special_tokens: dict[str, str] = {"eos_token": backend.id_to_token(self.eos_token_ids[0])}
        if bos_token_id is not None:
            self._special_tokens["bos_token"] = backend.id_to_token(bos_token_id)

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
        such as `<|im_start|>` becomes its special token."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation; raises `ChatTemplateError` when rendering fails."""
        try:
            return self._template.render(
                messages=[dict(message) for message in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template could not render these messages: {error}") from error
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as error:
            raise ChatTemplateError(
                f"the chat template could not render these messages: {type(error).__name__}: {error}"
            ) from error

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a conversation. The template writes any BOS itself, so none is added
        (as transformers' apply_chat_template(tokenize=True) does)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


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
