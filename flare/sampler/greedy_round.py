"""The round's short path for rounds whose rows are all greedy (or invalid): the torch twin of
greedy_tokens.c, for rounds of one position a row.

Without a token mask, draft probabilities or log-probabilities, each such row emits
argmax_i x_i of its logits x after its logit bias and penalties (the lowest index on ties, as
the shards' merge gives), so the general path's few hundred operators, which at one row cost
more to dispatch than to compute, reduce to a few dozen. On the CPU, `native.greedy_tokens`
computes the same in one call and also verifies greedy rows' deterministic drafts.
"""

from __future__ import annotations

from types import ModuleType

import torch

from flare.sampler.batch import SamplingBatch
from flare.sampler.penalties import PenaltyState
from flare.sampler.round_inputs import row_kinds
from flare.sampler.status import DeviceStatus


def greedy_round(
    logits: torch.Tensor, batch: SamplingBatch, max_drafts: int, kernels: ModuleType
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [R, max_drafts + 1] int64 (the argmax, then -1), emitted [R] int32 and status [R]
    int32 of a round of greedy or invalid rows with one position each: sample_round's results.

    The status is round_status's for such a row: no finite value after bias and penalties is
    EMPTY_DISTRIBUTION, a NaN or infinite raw logit NONFINITE_LOGITS (which wins), and invalid
    parameters win over both (their penalties are neutral, as in the general path). The
    operators apply the general path's own penalize_and_scale (`kernels`, the backend's), so the
    values compared are the same floats.
    """
    num_rows, width = logits.shape[0], max_drafts + 1
    facts = batch.facts
    invalid_params = row_kinds(batch).invalid_params
    penalties = None
    if facts.any_penalized:
        assert batch.prompt_ids is not None and batch.output_ids is not None
        penalties = PenaltyState.from_ids(batch.prompt_ids, batch.output_ids, logits.shape[1])
    rows = torch.arange(num_rows, device=logits.device)
    prepared = kernels.penalize_and_scale(
        logits,
        rows,
        torch.zeros_like(rows),
        torch.empty(num_rows, 0, dtype=torch.int64, device=logits.device),
        torch.ones(num_rows, device=logits.device),
        torch.where(invalid_params, 1.0, batch.repetition_penalty),
        torch.where(invalid_params, 0.0, batch.presence_penalty),
        torch.where(invalid_params, 0.0, batch.frequency_penalty),
        penalties,
        scale=False,
        bias=batch.dense_bias(logits.shape[1]),
    )
    chosen = prepared.scaled
    status = torch.full((num_rows,), int(DeviceStatus.OK), dtype=torch.int32, device=logits.device)
    if chosen is not logits:  # untouched logits are finite wherever the raw ones are
        status = torch.where(~torch.isfinite(chosen.amax(dim=-1)), int(DeviceStatus.EMPTY_DISTRIBUTION), status)
    status = torch.where(prepared.nonfinite, int(DeviceStatus.NONFINITE_LOGITS), status)
    status = torch.where(invalid_params, int(DeviceStatus.INVALID_SAMPLING_PARAMETERS), status)
    ok = status == int(DeviceStatus.OK)
    tokens = torch.full((num_rows, width), -1, dtype=torch.int64, device=logits.device)
    tokens[:, 0] = torch.where(ok, chosen.argmax(dim=-1), -1)
    return tokens, ok.to(torch.int32), status.to(torch.int32)
