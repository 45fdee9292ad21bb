"""The round's wire form: what rank 0 encodes is what a worker decodes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.parallel.sampling_cases import sampling_cases

from flare.engine.batch import ForwardRow
from flare.parallel.round_command import RoundCommand, RoundSampling
from flare.parallel.tensor_codec import decode, encode


def test_the_codec_returns_every_tensor_none_and_empty_shape_bit_for_bit() -> None:
    tensors = [
        torch.tensor([1.5, float("nan"), float("-inf"), -0.0]),
        None,
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.zeros(0, 4, dtype=torch.int32),
        torch.tensor([True, False]),
        torch.tensor(7),
    ]
    back = decode(encode(tensors))
    assert back[1] is None
    for sent, got in zip(tensors, back, strict=True):
        if sent is not None:
            assert got is not None and got.dtype == sent.dtype and got.shape == sent.shape
            assert torch.equal(sent.view(torch.uint8) if sent.dim() else sent, got.view(torch.uint8) if got.dim() else got)


def test_a_tensor_of_a_dtype_the_wire_does_not_carry_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        encode([torch.zeros(2, dtype=torch.complex64)])


@pytest.mark.parametrize("case", [c for c in sampling_cases() if c.kind == "round"], ids=lambda c: c.name)
def test_a_round_command_decodes_to_the_rows_copies_and_sampling_inputs_sent(case) -> None:
    rows = (
        ForwardRow(token_ids=(5, 6, 7), start_position=10, block_table=(3, 4), num_logits=3),
        ForwardRow(token_ids=(9,), start_position=0, block_table=(8,), num_logits=1),
        ForwardRow(token_ids=(), start_position=2, block_table=(), num_logits=0),
    )
    sampling = RoundSampling(
        case.num_drafts, case.draft_tokens, case.batch, case.token_mask, case.num_logprobs, case.raw_logprobs
    )
    command = RoundCommand(index=41, rows=rows, copies=((1, 2), (3, 5)), sampling=sampling)
    back = RoundCommand.decode(command.encode())
    assert back.index == 41 and back.rows == rows and back.copies == ((1, 2), (3, 5))
    assert back.sampling is not None
    assert back.sampling.num_logprobs == case.num_logprobs
    assert back.sampling.batch.facts == case.batch.facts
    for field in dataclasses.fields(case.batch):
        sent, got = getattr(case.batch, field.name), getattr(back.sampling.batch, field.name)
        if isinstance(sent, torch.Tensor):
            assert torch.equal(sent, got), field.name
    for name in ("num_drafts", "draft_tokens", "token_mask", "raw_logprobs"):
        sent, got = getattr(sampling, name), getattr(back.sampling, name)
        assert (sent is None and got is None) or torch.equal(sent, got), name


def test_a_round_without_sampling_carries_none() -> None:
    command = RoundCommand(index=0, rows=(ForwardRow((1, 2), 0, (0,), 0),), copies=(), sampling=None)
    assert RoundCommand.decode(command.encode()) == command
