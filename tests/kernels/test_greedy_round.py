"""A round of plain greedy rows takes sample_round's short path, with the general path's results."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flare.kernels.round as round_module
from flare.kernels.round import RoundResult, sample_round
from flare.kernels.status import DeviceStatus
from flare.sampling.params import SamplingParams

from .helpers import make_batch

VOCAB = 1000


def _greedy_logits(rows: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    if rows > 1:
        logits[1, 10] = logits[1, 500] = logits[1].max() + 1  # a tie: the lower index wins
    if rows > 2:
        logits[2, 7] = float("nan")
    if rows > 3:
        logits[3] = float("-inf")  # no finite logit at all
    if rows > 4:
        logits[4, 3] = float("inf")
    return logits


def _round(logits: torch.Tensor, batch, width: int, mask: torch.Tensor | None = None) -> RoundResult:
    rows = logits.shape[0]
    return sample_round(
        logits,
        num_drafts=torch.zeros(rows, dtype=torch.int64),
        draft_tokens=torch.full((rows, width), -1, dtype=torch.int64),
        draft_probs=None,
        batch=batch,
        token_mask=mask,
    )


@pytest.mark.parametrize("rows", [1, 2, 5, 7])
@pytest.mark.parametrize("width", [0, 1, 4])
@pytest.mark.parametrize("invalid_row", [None, 0])
def test_plain_greedy_rows_take_the_short_path_and_get_the_general_paths_tokens_and_statuses(
    rows: int, width: int, invalid_row: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = make_batch([SamplingParams(temperature=0.0)] * rows, prompt_ids=[[1, 2]] * rows, output_ids=[[3]] * rows)
    if invalid_row is not None:  # as the INVALID_SAMPLING_PARAMETERS fault does: facts unchanged
        temperature = batch.temperature.clone()
        temperature[invalid_row] = -1.0
        batch = dataclasses.replace(batch, temperature=temperature)
    logits = _greedy_logits(rows, seed=rows + width)
    short_calls = []
    greedy_round = round_module.greedy_round
    monkeypatch.setattr(round_module, "greedy_round", lambda *a: short_calls.append(1) or greedy_round(*a))

    short = _round(logits, batch, width)
    # A grammar mask that allows every token changes nothing but takes the general path.
    general = _round(logits, batch, width, mask=torch.full((rows, -(-VOCAB // 32)), -1, dtype=torch.int32))

    assert short_calls == [1]
    assert torch.equal(short.tokens, general.tokens)
    assert torch.equal(short.num_emitted, general.num_emitted)
    assert torch.equal(short.status, general.status)
    assert short.tokens.shape == (rows, width + 1) and short.tokens.dtype == general.tokens.dtype
    assert short.status.dtype == general.status.dtype == torch.int32
    statuses = short.status.tolist()
    if invalid_row is not None:
        assert statuses[invalid_row] == DeviceStatus.INVALID_SAMPLING_PARAMETERS
    if rows > 1 and invalid_row != 1:
        assert short.tokens[1, 0] == 10
    for bad in (2, 3, 4):
        if rows > bad:
            assert statuses[bad] == DeviceStatus.NONFINITE_LOGITS and short.tokens[bad].tolist() == [-1] * (width + 1)
    if rows == 1 and invalid_row is None:
        assert short.tokens[0, 0] == logits[0].argmax() and short.num_emitted.tolist() == [1]


@pytest.mark.parametrize(
    "change",
    [
        {"params": SamplingParams(temperature=0.7)},
        {"params": SamplingParams(temperature=0.0, repetition_penalty=1.3)},
        {"params": SamplingParams(temperature=0.0, logit_bias=((5, 2.0),))},
        {"num_logprobs": 2},
        {"drafts": 1},
    ],
    ids=["sampled", "penalised", "biased", "logprobs", "drafts"],
)
def test_anything_applied_to_the_logits_keeps_the_general_path(change: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(round_module, "greedy_round", lambda *a: pytest.fail("the short path ran"))
    params = change.get("params", SamplingParams(temperature=0.0))
    drafts = change.get("drafts", 0)
    batch = make_batch([params], prompt_ids=[[1, 2]], output_ids=[[3]])
    logits = torch.randn(1 + drafts, VOCAB, generator=torch.Generator().manual_seed(3))
    result = sample_round(
        logits,
        num_drafts=torch.tensor([drafts]),
        draft_tokens=torch.full((1, max(drafts, 1)), 4, dtype=torch.int64),
        draft_probs=None,
        batch=batch,
        num_logprobs=change.get("num_logprobs"),
    )
    assert result.status.tolist() == [DeviceStatus.OK]
