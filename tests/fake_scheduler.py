"""A scheduler with the real one's daemon-facing interface that streams canned events.

The HTTP API tests run against it, so they prove the API's behaviour without model weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from flare.engine.tokenizer import ChatTemplateError
from flare.package.reasoning_formats import ReasoningFormat
from flare.package.tool_formats import FLARE
from flare.policy.policy import SamplingPolicy
from flare.scheduler.stats import SchedulerObserver
from flare.scheduler.request import (
    Failed,
    Finished,
    GenerationRequest,
    RequestFailure,
    RequestStream,
    TextDelta,
    Usage,
)

POLICY = SamplingPolicy(
    defaults={
        "temperature": 0.7,
        "top_k": -1,
        "top_p": 0.9,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": 256,
    },
    ranges={
        "temperature": (0.0, 2.0),
        "top_k": (-1, 100),
        "top_p": (0.1, 1.0),
        "min_p": (0.0, 1.0),
        "repetition_penalty": (1.0, 1.5),
        "max_tokens": (1, 4096),
    },
)


class FakeTokenizer:
    """One token per character, so prompt lengths are easy to control."""

    eos_token_ids = (0,)
    knows_tools = False
    tool_format = FLARE
    reasoning_format: ReasoningFormat | None = None
    template_kwargs: Mapping[str, object] | None = None  # the last chat prompt's
    tool_tokens: dict[str, int] = {}
    takes_system_turn = True

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def fewest_tokens(self, characters: int) -> int:
        return characters

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode("utf-8")

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        *,
        special_tokens_in_content: bool = False,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]:
        self.template_kwargs = template_kwargs
        if any(m["content"] == "refuse" for m in messages):
            raise ChatTemplateError("the chat template could not render these messages: refused")
        opened = "" if continue_final_message else "<assistant>"
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + opened)


@dataclass
class FakeSnapshot:
    running: int
    waiting: int


class FakeScheduler:
    """Streams `reply` then `ending(request)` for each request.

    With `hold` the stream stops after the first delta and stays open until cancel(). With
    `refuse` set, submit raises it. Every submission and cancellation is recorded.
    """

    def __init__(self, *, max_context: int = 2048, reply: Sequence[str] = ("Hel", "lo", " wor", "ld")) -> None:
        self.tokenizer = FakeTokenizer()
        self.vocab_size = 50_000
        self.max_concurrency = 16
        self.grammars = None  # structured output needs the real compiler (tests/integration)
        self.policy = POLICY
        self.max_context = max_context
        self.reply = tuple(reply)
        self.ending: Callable[[GenerationRequest], Finished | Failed] = lambda request: Finished(
            "stop", Usage(len(request.prompt_token_ids), len(self.reply))
        )
        self.hold = False
        self.refuse: Exception | None = None
        self.draining = False
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[tuple[str, RequestFailure | None]] = []
        self._open: dict[str, tuple[RequestStream, GenerationRequest]] = {}
        # What the daemon's model endpoints read of the package (Ollama's /api/tags, /api/show).
        manifest = SimpleNamespace(model=SimpleNamespace(architecture="llama"), serving=SimpleNamespace(dtype="float32"))
        self.package = SimpleNamespace(path=Path("tiny-model"), manifest=manifest)
        self.observer = SchedulerObserver()  # the daemon registers no scheduler metrics for a fake
        self.warmed_up = False
        self._stopped = asyncio.Event()

    def submit(self, request: GenerationRequest) -> RequestStream:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(request)
        stream = RequestStream(request.request_id, choices=request.n)
        if self.hold:
            stream.put(TextDelta(self.reply[0], (1,)))
            self._open[request.request_id] = (stream, request)
            return stream
        # n choices interleave: each text of the reply for every choice in turn, choice i's
        # texts suffixed with i when there are several.
        for text in self.reply:
            for index in range(request.n):
                stream.put(TextDelta(text + (str(index) if request.n > 1 else ""), (1,), index))
        for index in range(request.n):
            ending = self.ending(request)
            stream.put(dataclasses.replace(ending, index=index) if isinstance(ending, Finished) else ending)
            if isinstance(ending, Failed):
                break
        return stream

    def cancel(self, request_id: str, failure: RequestFailure | None = None) -> bool:
        self.cancelled.append((request_id, failure))
        entry = self._open.pop(request_id, None)
        if entry is None:
            return False
        stream, request = entry
        failure = failure or RequestFailure("cancelled", "request cancelled", 503)
        stream.put(Failed(failure, Usage(len(request.prompt_token_ids), 1)))
        return True

    def release(self, request_id: str) -> None:
        """Let a held request finish normally."""
        stream, request = self._open.pop(request_id)
        for text in self.reply[1:]:
            stream.put(TextDelta(text, (1,)))
        stream.put(self.ending(request))

    def snapshot(self) -> FakeSnapshot:
        return FakeSnapshot(running=len(self._open), waiting=0)

    # The lifecycle the server drives.

    async def warm_up(self) -> None:
        self.warmed_up = True

    async def run(self) -> None:
        await self._stopped.wait()
        for request_id in list(self._open):
            self.cancel(request_id, RequestFailure("shutdown", "the server shut down", 503))

    def stop(self) -> None:
        self._stopped.set()

    def drain(self) -> None:
        self.draining = True
