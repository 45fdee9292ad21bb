"""Compiling constraints into llguidance matchers, bounded and cached.

llguidance was chosen over xgrammar for three reasons (docs/sampling.md has the figures):
it installs with no dependencies (xgrammar requires transformers, apache-tvm-ffi and triton on
top of torch); its compile and mask work is bounded by explicit fuel limits (`LLParserLimits`),
so a hostile schema or pattern fails fast with an error instead of stalling a thread; and it
computes the masks of a row's draft positions in one call, which speculative rounds need.

Every grammar is checked against flare's bounds (bounds.py), then validated and built once into
a prototype matcher whose first mask is computed at once: the lexer work a pattern needs happens
here, off the model's rounds, and a constraint nothing can satisfy is refused before any token.
Requests with the same constraint in the same scope (the daemon's: the API key, narrowed by
cache_salt) share the prototype through a cache bounded by entries and by bytes, and step deep copies of it (microseconds). Compilation drops the GIL; the daemon runs it
in a worker thread under a time limit, and each compile runs on a thread of its own with a large
stack, so a converter's recursion the bounds missed still cannot overflow it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import llguidance

from flare.structured.bounds import BoundError, check
from flare.structured.memory import give_back_heap, resident_bytes
from flare.structured.spec import GrammarSpec

__all__ = ["CacheUse", "Grammar", "GrammarCompiler", "GrammarError"]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON in one line with OpenAI's separators: a small model offered free whitespace can spend
its whole budget on newlines, and fixed separators are forced tokens that jump-forward skips."""

MAX_CHOICES = 1_000

LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=100_000, step_max_items=2_000)
"""llguidance's limits, two of them tightened from its defaults so that one constraint cannot
stall the round: with the default `initial_lexer_fuel` a pattern such as `^(X{1000}){1000}$`
builds its lexer eagerly, in seconds and hundreds of MB (tightened, lazily, and is still
served); with the default `step_max_items` an ambiguous grammar such as `a: a a a | a a | a |
"x"` can take seconds for one mask, stalling every other row (tightened, it fails its own row).
docs/benchmarks.md, "Structured output", has the figures."""

CACHE_ENTRIES = 256
CACHE_BYTES = 256 * 1024 * 1024
"""The grammar cache's bound in bytes (each entry's estimate: the resident memory its compile
added). A grammar larger than the whole bound is served but not kept."""

COMPILE_STACK_BYTES = 64 * 1024 * 1024
"""The stack of the thread a compile runs on: virtual memory, touched only as deep as the
converters recurse (3,000 chained rules, 8 times past flare's bound, compile in 64 MiB)."""

_Result = TypeVar("_Result")


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
    bytes: int = 0  # the estimate the cache counts: resident memory its compile added


@dataclass(frozen=True)
class CacheUse:
    """What the grammar cache holds: entries and their estimated bytes."""

    entries: int
    bytes: int


class GrammarCompiler:
    """Owns the tokenizer llguidance reads the vocabulary from, the mask executor and the cache.

    The tokenizer (costly to build for a large vocabulary) and the executor are made by the first
    compile, so a server that never sees a constraint never pays for them. Safe to call from
    several worker threads: the cache is locked, compilation is not (two threads may compile one
    new grammar at once; the later result replaces the earlier in the cache). An entry's bytes
    are an estimate: the process's resident growth over its compile, which other threads'
    allocations at the same moment blur; at least its source's length."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = CACHE_ENTRIES,
        cache_bytes: int = CACHE_BYTES,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = list(eos_token_ids)
        self._engine: tuple[llguidance.LLTokenizer, llguidance.LLExecutor] | None = None
        self.limits = limits or LIMITS
        self._cache: OrderedDict[tuple[bytes, str, str], Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._stack_lock = threading.Lock()

    def _tokenizer_and_executor(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        with self._lock:
            if self._engine is None:
                tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos_token_ids
                )
                self._engine = (tokenizer, llguidance.LLExecutor(num_threads=2))
            return self._engine

    def compile(self, spec: GrammarSpec, *, scope: bytes = b"") -> Grammar:
        """The grammar of `spec`, from the cache or compiled now (blocking: call it off the
        event loop). Raises GrammarError naming spec.param.

        `scope` says whose compiles it may find: a cache hit answers faster, so a grammar found
        from another scope would tell its caller that someone there sent this exact schema.
        The daemon passes the request's prefix-cache scope (its API key, narrowed by cache_salt)."""
        key = spec.cache_key(scope)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                # The same constraint from another field: errors name this request's field.
                return cached if cached.spec == spec else dataclasses.replace(cached, spec=spec)
        tokenizer, executor = self._tokenizer_and_executor()
        prototype, size = self._on_large_stack(self._build, spec, tokenizer)
        grammar = Grammar(spec, prototype, tokenizer, executor, size)
        evicted = False
        with self._lock:
            if size <= self._cache_bytes:
                self._cache[key] = grammar
            while len(self._cache) > self._cache_size or self._bytes_locked() > self._cache_bytes:
                self._cache.popitem(last=False)
                evicted = True
        if evicted:
            give_back_heap()
        return grammar

    def cached(self, spec: GrammarSpec, *, scope: bytes = b"") -> bool:
        with self._lock:
            return spec.cache_key(scope) in self._cache

    def use(self) -> CacheUse:
        with self._lock:
            return CacheUse(len(self._cache), self._bytes_locked())

    def clear(self) -> CacheUse:
        """Drop every cached grammar (requests running keep theirs); returns what was dropped."""
        with self._lock:
            dropped = CacheUse(len(self._cache), self._bytes_locked())
            self._cache.clear()
        give_back_heap()
        return dropped

    def _bytes_locked(self) -> int:
        return sum(grammar.bytes for grammar in self._cache.values())

    def _on_large_stack(self, work: Callable[..., _Result], *args: object) -> _Result:
        """`work(*args)` on a new thread with a COMPILE_STACK_BYTES stack, waited for.
        threading.stack_size applies to threads started while it is set, so it is set and
        restored around the start alone."""
        outcome: list[_Result] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                outcome.append(work(*args))
            except BaseException as error:  # handed to the caller's thread below
                failure.append(error)

        thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
        with self._stack_lock:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                thread.start()
            finally:
                threading.stack_size(previous)
        thread.join()
        if failure:
            raise failure[0]
        return outcome[0]

    def _build(self, spec: GrammarSpec, tokenizer: llguidance.LLTokenizer) -> tuple[llguidance.LLMatcher, int]:
        """The prototype matcher, with its first mask computed, and the resident bytes its
        compile added (at least the source's length). A failed compile gives its heap back."""
        before = resident_bytes()
        try:
            matcher = self._matcher(spec, tokenizer)
        except GrammarError as error:
            # Without its traceback, whose frames hold the failed matcher, so the trim finds it freed.
            refused = error.with_traceback(None)
        else:
            return matcher, max(resident_bytes() - before, len(spec.source))
        give_back_heap()
        raise refused

    def _matcher(self, spec: GrammarSpec, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        try:
            check(spec.kind, spec.source)
            text = _grammar_text(spec)
        except (BoundError, ValueError) as error:
            raise GrammarError(spec.param, _clean(str(error))) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer, limits=self.limits)
        if is_error:
            raise GrammarError(spec.param, _clean(messages[0] if messages else "the grammar is invalid"))
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(spec.param, _clean(matcher.get_error()))
        _check_first_step(matcher, spec)
        return matcher


def _check_first_step(matcher: llguidance.LLMatcher, spec: GrammarSpec) -> None:
    """Compute the first mask on copies: it builds the lexer states the first token needs (here,
    not in a model round; the copies share them), and tells a constraint that cannot be served.
    Nothing can satisfy some (`{"$ref": "#"}`, the regex `[^\\s\\S]`, Lark `start: start "a"`):
    llguidance stops them at once. A lexer past its limits (`^(X{1000}){1000}$`) answers the
    first mask and fails the next, on the states the first left shared: so two copies ask."""
    for _ in range(2):
        first = matcher.deep_copy()
        first.compute_bitmask()
        if first.is_error():
            error = first.get_error()
            if "NoExtension" in error:
                raise GrammarError(
                    spec.param, "nothing can satisfy this constraint: no answer, not even an empty one, matches it"
                )
            raise GrammarError(spec.param, _clean(error))
        if first.is_stopped() and not first.is_accepting():
            raise GrammarError(spec.param, "nothing can satisfy this constraint: no answer matches it")


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
    # llguidance appends a dump of the parser's state after "<state>": not for the client.
    message = message.split("<state>", 1)[0]
    first = " ".join(line.strip() for line in message.strip().splitlines()[:3] if line.strip())
    return first[:500] or "the grammar is invalid"
