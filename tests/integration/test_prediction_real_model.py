"""OpenAI's predicted outputs on the default model, through the official SDK unchanged: a
prediction of the model's own greedy answer gives that same answer, with its predicted tokens
accepted as drafts, streamed or not (the streamed counts in the usage chunk)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

pytestmark = pytest.mark.real_model
PARAGRAPH = (
    "The river runs past the old mill, under the stone bridge and through the village, "
    "where children watch the boats go by on summer evenings."
)
ASK = [{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}"}]


@pytest.fixture(scope="module")
def daemon(default_package: Path) -> Iterator[DaemonProcess]:
    """The default model with the drafts' length held fixed, so that a prediction is verified
    wherever it proposes. These tests count its accepted tokens; on the session's shared daemon,
    whose adaptive draft-length model weighs drafts by the round times and acceptance every
    module's requests taught it, one run drafted none of the prediction (the answer still right)."""
    process = start_daemon(
        None, ["--max-concurrency", "4", "--draft-length", "fixed"], env={"FLARE_CACHE_DIR": str(default_package.parents[1])}
    )
    yield process
    assert process.stop() == 0, process.log()


async def test_a_prediction_of_the_greedy_answer_gives_the_same_answer_with_its_tokens_accepted(
    client: openai.AsyncOpenAI, model: str
) -> None:
    plain = await client.chat.completions.create(model=model, messages=ASK, max_tokens=64, temperature=0)
    answer = plain.choices[0].message.content or ""
    assert answer and plain.usage is not None
    assert plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0

    predicted = await client.chat.completions.create(
        model=model, messages=ASK, max_tokens=64, temperature=0, prediction={"type": "content", "content": answer}
    )
    assert predicted.choices[0].message.content == answer
    assert predicted.usage is not None and predicted.usage.completion_tokens == plain.usage.completion_tokens
    details = predicted.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens is not None
    assert details.accepted_prediction_tokens > 0


async def test_a_streamed_answer_reports_the_prediction_tokens_in_its_usage_chunk(
    client: openai.AsyncOpenAI, model: str
) -> None:
    plain = await client.chat.completions.create(model=model, messages=ASK, max_tokens=64, temperature=0)
    answer = plain.choices[0].message.content or ""
    stream = await client.chat.completions.create(
        model=model, messages=ASK, max_tokens=64, temperature=0, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": answer},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens is not None and details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens is not None
