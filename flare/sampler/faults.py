"""Fault injection: make the real device path produce a given status on one row (tests only).

``flare run --fault-injection`` lets a request ask for a status (``X-Flare-Fault``); the
scheduler then corrupts that row's inputs to sample_round here, so the status comes out of the
same kernels as a real failure would, and the other rows of the round are served as usual.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flare.sampler.batch import SamplingBatch
from flare.sampler.status import DeviceStatus

TEMPERATURE_THAT_OVERFLOWS = 1e-45
"""A positive float32 temperature so small that logit / temperature overflows to infinity."""


@dataclass(frozen=True)
class FaultedRound:
    """sample_round inputs with one row corrupted (pass them on in place of the originals)."""

    logits: torch.Tensor
    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    batch: SamplingBatch


class FaultNotInjectable(ValueError):
    """The status cannot arise on this row in this round (e.g. a draft fault on a row without drafts)."""


def inject_fault(
    status: DeviceStatus,
    *,
    row: int,
    first_logit_row: int,
    row_num_drafts: int,
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    vocab_shards: int,
) -> FaultedRound:
    """Corrupt row ``row`` (whose positions start at logits row ``first_logit_row`` and which has
    ``row_num_drafts`` drafts, both known on the host) so that sample_round reports ``status``.

    Writes NaN into ``logits`` in place for NONFINITE_LOGITS; other inputs are copied.
    Raises FaultNotInjectable when the status cannot arise for this row in this round.
    """
    vocab_size = logits.shape[1]
    if status == DeviceStatus.NONFINITE_LOGITS:
        logits[first_logit_row, 0] = float("nan")
        return FaultedRound(logits, draft_tokens, draft_probs, batch)
    if status in (DeviceStatus.INVALID_DRAFT_TOKEN, DeviceStatus.INVALID_DRAFT_PROBABILITY) and row_num_drafts == 0:
        raise FaultNotInjectable(f"{status.name} needs a row with drafts; row {row} has none this round")
    if status == DeviceStatus.INVALID_DRAFT_TOKEN:
        draft_tokens = draft_tokens.clone()
        draft_tokens[row, 0] = vocab_size
        return FaultedRound(logits, draft_tokens, draft_probs, batch)
    if status == DeviceStatus.INVALID_DRAFT_PROBABILITY:
        if draft_probs is None:
            # One-hot q written out: the same verification for every other row.
            valid = (draft_tokens >= 0) & (draft_tokens < vocab_size)
            draft_probs = torch.zeros(*draft_tokens.shape, vocab_size, dtype=torch.float32, device=logits.device)
            draft_probs.scatter_(2, draft_tokens.clamp(0, vocab_size - 1).unsqueeze(2), valid.unsqueeze(2).float())
        else:
            draft_probs = draft_probs.clone()
        draft_probs[row, 0] = 0.0
        return FaultedRound(logits, draft_tokens, draft_probs, batch)
    if status == DeviceStatus.EMPTY_DISTRIBUTION:
        facts = dataclasses.replace(batch.facts, any_sampled=True, any_temperature_scaling=True)
        batch = dataclasses.replace(
            _with_row_value(batch, "temperature", row, TEMPERATURE_THAT_OVERFLOWS), facts=facts
        )
        return FaultedRound(logits, draft_tokens, draft_probs, batch)
    if status == DeviceStatus.INVALID_SAMPLING_PARAMETERS:
        return FaultedRound(logits, draft_tokens, draft_probs, _with_row_value(batch, "temperature", row, -1.0))
    if status == DeviceStatus.INVALID_SPECULATION:
        if vocab_shards == 1:
            raise FaultNotInjectable("INVALID_SPECULATION arises only in a vocabulary-parallel round (vocab_shards > 1)")
        batch = _with_row_value(_with_row_value(batch, "top_k", row, 1), "temperature", row, 1.0)
        facts = dataclasses.replace(batch.facts, any_sampled=True, any_filtered=True)
        return FaultedRound(logits, draft_tokens, draft_probs, dataclasses.replace(batch, facts=facts))
    raise FaultNotInjectable(f"no fault to inject for status {status.name}")


def _with_row_value(batch: SamplingBatch, field: str, row: int, value: float) -> SamplingBatch:
    tensor = getattr(batch, field).clone()
    tensor[row] = value
    return dataclasses.replace(batch, **{field: tensor})
