"""Tokenizing a long text in a worker thread leaves the interpreter to other threads (the event
loop): `tokenizers` holds the GIL through `encode`, and releases it in `encode_batch`."""

from __future__ import annotations

import threading
import time

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from flare.engine.tokenizer import Tokenizer


def _tokenizer() -> Tokenizer:
    vocabulary = {chr(c): i for i, c in enumerate(range(32, 127))}
    backend = BackendTokenizer(models.BPE(vocab=vocabulary, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(backend, "{{ messages[0]['content'] }}", eos_token_ids=[0])


def test_another_thread_runs_while_a_long_text_is_tokenized() -> None:
    tokenizer = _tokenizer()
    text = "abc def ghi " * 30_000  # 360 kB: about a second of tokenizing on this machine
    ticks = 0
    done = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.monotonic()
    tokenizer.encode(text)
    encode_s = time.monotonic() - started
    done.set()
    ticker.join()
    # Holding the GIL, the encode would let the ticker run about once per switch interval at best
    # (and tokenizers' Rust code never yields it); released, the ticker runs every millisecond or so.
    assert ticks >= 0.2 * encode_s * 1000, (ticks, encode_s)
