"""Every device status is produced by the condition it names, on its row alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from flare.sampler.round import SampledRound, sample_round
from flare.sampler.shards import LocalShards
from flare.sampler.status import DeviceStatus
from flare.policy.params import SamplingParams

from .helpers import dirichlet, make_batch

VOCAB = 300
ROWS = 4
DRAFTS = 2
BAD = 1


def _round_inputs() -> dict:
    generator = torch.Generator().manual_seed(8)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, repetition_penalty=1.2),
    ]
    logits = torch.randn(ROWS * (DRAFTS + 1), VOCAB, generator=generator) * 2
    draft_tokens = torch.randint(0, VOCAB, (ROWS, DRAFTS), generator=generator)
    draft_probs = dirichlet(1.0, VOCAB, (ROWS, DRAFTS), seed=8)
    draft_probs.scatter_(2, draft_tokens.unsqueeze(2), 0.5)
    return {
        "logits": logits,
        "num_drafts": torch.full((ROWS,), DRAFTS),
        "draft_tokens": draft_tokens,
        "draft_probs": draft_probs,
        "params": params,
        "vocab_shards": 1,
    }


def _run(inputs: dict) -> SampledRound:
    params = inputs["params"]
    batch = make_batch(params, seeds=[5, 6, 7, 8], prompt_ids=[[1, 2]] * ROWS, output_ids=[[3]] * ROWS)
    return sample_round(
        inputs["logits"], inputs["num_drafts"], inputs["draft_tokens"], inputs["draft_probs"], batch, LocalShards(inputs["vocab_shards"])
    )


def _logit(value: float) -> Callable[[dict], None]:
    def corrupt(inputs: dict) -> None:
        inputs["logits"][BAD * (DRAFTS + 1) + 1, 17] = value

    return corrupt


def _draft_token(value: int) -> Callable[[dict], None]:
    def corrupt(inputs: dict) -> None:
        inputs["draft_tokens"][BAD, 1] = value

    return corrupt


def _draft_probability(value: float) -> Callable[[dict], None]:
    def corrupt(inputs: dict) -> None:
        inputs["draft_probs"][BAD, 0, inputs["draft_tokens"][BAD, 0]] = value

    return corrupt


def _param(**changes: float) -> Callable[[dict], None]:
    def corrupt(inputs: dict) -> None:
        inputs["params"][BAD] = dataclasses.replace(inputs["params"][BAD], **changes)

    return corrupt


def _sharded_filter(inputs: dict) -> None:
    inputs["vocab_shards"] = 2
    inputs["params"][BAD] = dataclasses.replace(inputs["params"][BAD], top_k=20)
    inputs["params"][2] = dataclasses.replace(inputs["params"][2], top_p=1.0)


CASES = {
    "nan_logit": (_logit(float("nan")), DeviceStatus.NONFINITE_LOGITS),
    "inf_logit": (_logit(float("inf")), DeviceStatus.NONFINITE_LOGITS),
    "minus_inf_logit": (_logit(float("-inf")), DeviceStatus.NONFINITE_LOGITS),
    "draft_token_past_vocab": (_draft_token(VOCAB), DeviceStatus.INVALID_DRAFT_TOKEN),
    "negative_draft_token": (_draft_token(-3), DeviceStatus.INVALID_DRAFT_TOKEN),
    "zero_draft_probability": (_draft_probability(0.0), DeviceStatus.INVALID_DRAFT_PROBABILITY),
    "draft_probability_above_one": (_draft_probability(1.5), DeviceStatus.INVALID_DRAFT_PROBABILITY),
    "nan_draft_probability": (_draft_probability(float("nan")), DeviceStatus.INVALID_DRAFT_PROBABILITY),
    "temperature_overflow": (_param(temperature=1e-45), DeviceStatus.EMPTY_DISTRIBUTION),
    "negative_temperature": (_param(temperature=-1.0), DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    "nan_temperature": (_param(temperature=float("nan")), DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    "zero_top_p": (_param(top_p=0.0), DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    "top_p_above_one": (_param(top_p=1.5), DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    "top_k_below_minus_one": (_param(top_k=-2), DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    "min_p_above_one": (_param(min_p=1.5), DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    "zero_repetition_penalty": (_param(repetition_penalty=0.0), DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    "infinite_presence_penalty": (_param(presence_penalty=float("inf")), DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    "filter_in_vocabulary_parallel_round": (_sharded_filter, DeviceStatus.INVALID_SPECULATION),
}


@pytest.mark.parametrize("case", CASES.keys())
def test_status_fails_only_the_row_that_caused_it(case: str) -> None:
    corrupt, expected = CASES[case]
    inputs = _round_inputs()
    corrupt(inputs)
    healthy = _round_inputs()
    healthy["vocab_shards"] = inputs["vocab_shards"]
    healthy["params"] = [p if r == BAD else inputs["params"][r] for r, p in enumerate(healthy["params"])]
    failed, baseline = _run(inputs), _run(healthy)
    assert (baseline.status == 0).all()
    assert int(failed.status[BAD]) == expected
    assert int(failed.num_emitted[BAD]) == 0
    assert (failed.tokens[BAD] == -1).all()
    others = [r for r in range(ROWS) if r != BAD]
    assert failed.status[others].tolist() == [0] * len(others)
    assert torch.equal(failed.tokens[others], baseline.tokens[others])
    assert torch.equal(failed.num_emitted[others], baseline.num_emitted[others])


def test_status_codes_are_int32_and_tokens_are_padded_after_the_emitted_ones() -> None:
    result = _run(_round_inputs())
    assert result.status.dtype == torch.int32 and result.num_emitted.dtype == torch.int32
    assert result.tokens.shape == (ROWS, DRAFTS + 1) and result.tokens.dtype == torch.int64
    for row in range(ROWS):
        emitted = int(result.num_emitted[row])
        assert 1 <= emitted <= DRAFTS + 1
        assert (result.tokens[row, :emitted] >= 0).all()
        assert (result.tokens[row, emitted:] == -1).all()


def test_shape_mistakes_raise_a_precise_error() -> None:
    inputs = _round_inputs()
    with pytest.raises(ValueError, match="draft_probs must be"):
        inputs["draft_probs"] = inputs["draft_probs"][:, :, :10]
        _run(inputs)
    with pytest.raises(ValueError, match="LocalShards.count must be between 1 and the vocabulary size"):
        inputs = _round_inputs()
        inputs["vocab_shards"] = 0
        _run(inputs)
