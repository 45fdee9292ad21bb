"""Fault injection produces each status through the real kernels, on the faulted row alone."""

from __future__ import annotations

import pytest
import torch

from flare.sampler.faults import FaultNotInjectable, inject_fault
from flare.sampler.round import sample_round
from flare.sampler.shards import LocalShards
from flare.sampler.status import DeviceStatus
from flare.policy.params import SamplingParams

from .helpers import make_batch

VOCAB = 200
DRAFTS = [2, 0, 3, 1]


def _round(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    logits = torch.randn(sum(DRAFTS) + len(DRAFTS), VOCAB, generator=generator) * 2
    draft_tokens = torch.randint(0, VOCAB, (4, 3), generator=generator)
    return logits, torch.tensor(DRAFTS), draft_tokens, make_batch(params, seeds=[1, 2, 3, 4])


FAULTS = [s for s in DeviceStatus if s != DeviceStatus.OK]


@pytest.mark.parametrize("status", FAULTS, ids=[s.name for s in FAULTS])
@pytest.mark.parametrize("row", [0, 2])
def test_injected_fault_reaches_only_its_row(status: DeviceStatus, row: int) -> None:
    shards = 2 if status == DeviceStatus.INVALID_SPECULATION else 1
    logits, num_drafts, draft_tokens, batch = _round()
    baseline = sample_round(logits, num_drafts, draft_tokens, None, batch, LocalShards(shards))
    first_logit_row = sum(d + 1 for d in DRAFTS[:row])
    faulted = inject_fault(
        status, row=row, first_logit_row=first_logit_row, row_num_drafts=DRAFTS[row],
        logits=logits.clone(), draft_tokens=draft_tokens, draft_probs=None, batch=batch, vocab_shards=shards,
    )
    result = sample_round(faulted.logits, num_drafts, faulted.draft_tokens, faulted.draft_probs, faulted.batch, LocalShards(shards))
    assert int(result.status[row]) == status
    assert int(result.num_emitted[row]) == 0
    others = [r for r in range(4) if r != row]
    assert (result.status[others] == 0).all()
    assert torch.equal(result.tokens[others], baseline.tokens[others])


def test_draft_faults_on_a_row_without_drafts_are_refused() -> None:
    logits, _, draft_tokens, batch = _round()
    with pytest.raises(FaultNotInjectable, match="needs a row with drafts"):
        inject_fault(
            DeviceStatus.INVALID_DRAFT_TOKEN, row=1, first_logit_row=3, row_num_drafts=0,
            logits=logits, draft_tokens=draft_tokens, draft_probs=None, batch=batch, vocab_shards=1,
        )
    with pytest.raises(FaultNotInjectable, match="vocabulary-parallel"):
        inject_fault(
            DeviceStatus.INVALID_SPECULATION, row=1, first_logit_row=3, row_num_drafts=0,
            logits=logits, draft_tokens=draft_tokens, draft_probs=None, batch=batch, vocab_shards=1,
        )
