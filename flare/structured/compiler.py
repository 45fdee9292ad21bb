"""Compiling constraints into llguidance matchers, bounded and cached.

llguidance was chosen over xgrammar for three reasons (docs/sampling.md has the figures):
it installs with no dependencies (xgrammar requires transformers, apache-tvm-ffi and triton on
top of torch); its compile and mask work is bounded by explicit fuel limits (`LLParserLimits`),
so a hostile schema or pattern fails fast with an error instead of stalling a thread; and it
computes the masks of a row's draft positions in one call, which speculative rounds need.

Every grammar is validated and built once into a prototype matcher; requests with the same
constraint share it through a bounded LRU cache and step deep copies of it (microseconds).
Compilation drops the GIL; the daemon runs it in a worker thread under a time limit.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance

from flare.structured.spec import GrammarSpec

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON in one line with OpenAI's separators: a small model offered free whitespace can spend
its whole budget on newlines, and fixed separators are forced tokens that jump-forward skips."""

MAX_SOURCE_CHARS = 200_000
"""The largest schema, pattern or grammar text accepted (the body limit bounds it too)."""

MAX_CHOICES = 1_000


class GrammarError(ValueError):
    """A constraint that cannot be served: invalid, unsupported, or beyond the compile limits."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: the prototype every request's state copies."""

    spec: GrammarSpec
    prototype: llguidance.LLMatcher
    tokenizer: llguidance.LLTokenizer
    executor: llguidance.LLExecutor


class GrammarCompiler:
    """Owns the tokenizer llguidance reads the vocabulary from, the mask executor and the cache.

    The tokenizer (about 0.2 s to build for 49152 tokens) and the executor are made by the first
    compile, so a server that never sees a constraint never pays for them. Safe to call from
    several worker threads: the cache is locked, compilation is not (two threads may compile one
    new grammar at once; the second result is dropped)."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 256,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = list(eos_token_ids)
        self._engine: tuple[llguidance.LLTokenizer, llguidance.LLExecutor] | None = None
        # llguidance's defaults bound one compile to about 20 ms of lexer work and one mask to
        # about 15 ms; a grammar past them is refused.
        self.limits = limits or llguidance.LLParserLimits()
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _tokenizer_and_executor(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        with self._lock:
            if self._engine is None:
                tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos_token_ids
                )
                self._engine = (tokenizer, llguidance.LLExecutor(num_threads=2))
            return self._engine

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The grammar of `spec`, from the cache or compiled now (blocking: call it off the
        event loop). Raises GrammarError naming spec.param."""
        with self._lock:
            cached = self._cache.get(spec.cache_key)
            if cached is not None:
                self._cache.move_to_end(spec.cache_key)
                return cached
        tokenizer, executor = self._tokenizer_and_executor()
        grammar = Grammar(spec, self._build(spec, tokenizer), tokenizer, executor)
        with self._lock:
            self._cache[spec.cache_key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec.cache_key in self._cache

    def _build(self, spec: GrammarSpec, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        if len(spec.source) > MAX_SOURCE_CHARS:
            raise GrammarError(spec.param, f"is {len(spec.source)} characters; at most {MAX_SOURCE_CHARS} are accepted")
        try:
            text = _grammar_text(spec)
        except ValueError as error:
            raise GrammarError(spec.param, _clean(str(error))) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer, limits=self.limits)
        if is_error:
            raise GrammarError(spec.param, _clean(messages[0] if messages else "the grammar is invalid"))
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(spec.param, _clean(matcher.get_error()))
        return matcher


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    choices = json.loads(spec.source)
    # A choice is matched literally: a Lark alternation of JSON-quoted strings.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _clean(message: str) -> str:
    """llguidance's message on one line, without its source excerpt's caret art."""
    first = " ".join(line.strip() for line in message.strip().splitlines()[:3] if line.strip())
    return first[:500] or "the grammar is invalid"
