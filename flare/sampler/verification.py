"""Speculative verification: which drafts a row accepts, what it samples after them, and the
tokens it emits (Leviathan et al. 2023; Chen et al. 2023).

For a sampled row with drafts x_0 .. x_{k-1} from draft distributions q_j and target p_j:
draft j is accepted with probability min(1, p_j(x_j) / q_j(x_j)) (rejection sampling), and
verification stops at the first rejection. At the first rejection, position a, the token is
drawn from the residual normalize(max(p_a - q_a, 0)); when every draft is accepted, a bonus token
is drawn from p_k. Every emitted token then follows p exactly:
P(x) = min(p(x), q(x)) + max(p(x) - q(x), 0) = p(x). A greedy row accepts a draft iff it is the
argmax, and emits the argmax after the accepted ones: exactly the argmax continuation. Each
row's status (`round_status`) decides whether it emits at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.sampler.batch import SamplingBatch
from flare.sampler.gumbel_max import GumbelCandidates
from flare.sampler.random_stream import Purpose, stream_bits, stream_key, uniform
from flare.sampler.shards import best_candidate
from flare.sampler.status import DeviceStatus


def greedy_acceptance(drafts: torch.Tensor, argmax: torch.Tensor, draft_position: torch.Tensor) -> torch.Tensor:
    """[R, Kmax]: draft x_j accepted iff x_j = argmax_i p_j(i) at its position."""
    return drafts == argmax[draft_position]


def rejection_acceptance(
    draft_logit: torch.Tensor,
    draft_threshold: torch.Tensor,
    draft_max: torch.Tensor,
    draft_sumexp: torch.Tensor,
    q_draft: torch.Tensor | None,
    batch: SamplingBatch,
    draft_index: torch.Tensor,
) -> torch.Tensor:
    """[R, Kmax]: draft x_j accepted with probability min(1, p_j(x_j) / q_j(x_j)), drawn as
    ``u * q < p`` with u from the row's stream (seed, output position, ACCEPT). p_j(x_j) =
    exp(logit - m) / Z on the kept set (logit >= threshold), from the draft's logit, kept-set
    threshold, merged max m and sum Z at its position; q None is a deterministic drafter's
    one-hot q = 1, whose test is ``u < p``."""
    p_draft = torch.where(draft_logit >= draft_threshold, torch.exp(draft_logit - draft_max), 0.0) / draft_sumexp
    output_position = batch.first_position.unsqueeze(1) + draft_index.unsqueeze(0)
    accept_key = stream_key(batch.seed.unsqueeze(1), output_position, Purpose.ACCEPT)
    u = uniform(stream_bits(accept_key, torch.zeros_like(accept_key)))
    if q_draft is None:
        return u < p_draft
    return u * q_draft < p_draft


def accepted_counts(accept: torch.Tensor, is_draft: torch.Tensor) -> torch.Tensor:
    """[R] int64: the drafts accepted before the first rejection, prod_{i <= j} accept_i summed."""
    return (accept & is_draft).to(torch.int64).cumprod(1).sum(1)


@dataclass(frozen=True)
class TokenDraw:
    """What each row samples after verification, by Gumbel-max argmax_i(log p_i + G_i) with the
    stream (seed, output position, SAMPLE): the correction after a rejection, else the bonus."""

    sample_position: torch.Tensor
    """[R]: the position sampled, the row's first plus its accepted drafts."""
    key: torch.Tensor
    """[R] int32: the random stream of the draw."""
    rejected: torch.Tensor
    """[R] bool: a draft was rejected there, so the token comes from the residual."""
    exclude: torch.Tensor
    """[R]: with one-hot drafts, the rejected draft's vocabulary id (max(p - e_x, 0) is p without
    x), -1 elsewhere."""
    draft_q: torch.Tensor | None
    """[R, width] float32: with draft distributions, q at the sampled position (the residual's)."""


def token_draw(
    batch: SamplingBatch,
    row_start: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    num_accepted: torch.Tensor,
) -> TokenDraw:
    """The draw of every row after ``num_accepted`` of its ``num_drafts`` drafts."""
    num_rows, max_drafts = drafts.shape
    rejected = num_accepted < num_drafts
    exclude = torch.full((num_rows,), -1, dtype=torch.int64, device=drafts.device)
    draft_q = None
    if max_drafts > 0:
        at_rejection = num_accepted.clamp(max=max_drafts - 1)
        if draft_probs is None:
            rejected_token = drafts.gather(1, at_rejection.unsqueeze(1)).squeeze(1)
            exclude = torch.where(rejected, rejected_token, -1)
        else:
            draft_q = draft_probs[torch.arange(num_rows, device=drafts.device), at_rejection].float()
    return TokenDraw(
        sample_position=row_start + num_accepted,
        key=stream_key(batch.seed, batch.first_position + num_accepted, Purpose.SAMPLE),
        rejected=rejected,
        exclude=exclude,
        draft_q=draft_q,
    )


def sampled_token(candidates: GumbelCandidates, rejected: torch.Tensor) -> torch.Tensor:
    """[R]: the sampled token from the shards' [R, S] Gumbel-max candidates: the best candidate of
    p, or, after a rejection against a general q, the best of the residual max(p - q, 0)."""
    token = best_candidate(candidates.index, candidates.value)
    if candidates.residual_index is None:
        return token
    assert candidates.residual_value is not None and candidates.residual_mass is not None
    residual_token = best_candidate(candidates.residual_index, candidates.residual_value)
    # A residual of zero mass has probability zero in exact arithmetic (rejection then happens
    # with probability sum max(p - q, 0) = 0); after rounding, sample from p.
    use_residual = rejected & (candidates.residual_mass.sum(1) > 0)
    return torch.where(use_residual, residual_token, token)


def round_status(
    empty_row: torch.Tensor,
    nonfinite_row: torch.Tensor,
    invalid_draft_prob: torch.Tensor,
    invalid_draft_token: torch.Tensor,
    invalid_speculation: torch.Tensor,
    invalid_params: torch.Tensor,
) -> torch.Tensor:
    """[R] DeviceStatus codes of a round's rows from their [R] bool conditions; the later
    conditions win over the earlier ones (greedy_tokens.c reports the same order). A row whose
    status is not OK emits nothing."""
    status = torch.where(empty_row, int(DeviceStatus.EMPTY_DISTRIBUTION), int(DeviceStatus.OK))
    for condition, code in (
        (nonfinite_row, DeviceStatus.NONFINITE_LOGITS),
        (invalid_draft_prob, DeviceStatus.INVALID_DRAFT_PROBABILITY),
        (invalid_draft_token, DeviceStatus.INVALID_DRAFT_TOKEN),
        (invalid_speculation, DeviceStatus.INVALID_SPECULATION),
        (invalid_params, DeviceStatus.INVALID_SAMPLING_PARAMETERS),
    ):
        status = torch.where(condition, int(code), status)
    return status


def emitted_tokens(drafts: torch.Tensor, num_accepted: torch.Tensor, token: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """[R, Kmax + 1]: the accepted drafts, then the sampled token, -1 after it and on failed rows."""
    num_rows, max_drafts = drafts.shape
    slot = torch.arange(max_drafts + 1, device=drafts.device).unsqueeze(0)
    accepted = num_accepted.unsqueeze(1)
    drafts_then_pad = torch.cat([drafts, drafts.new_full((num_rows, 1), -1)], 1)
    tokens = torch.where(slot < accepted, drafts_then_pad, torch.where(slot == accepted, token.unsqueeze(1), -1))
    return torch.where(ok.unsqueeze(1), tokens, -1)
