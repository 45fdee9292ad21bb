"""Log-probabilities of emitted tokens and of the most likely ones, from the round's statistics.

The distribution reported is the one a token is sampled from: the target p after the token
mask, the logit bias, the penalties, the temperature and the filters, i.e.
``log p_i = scaled_i - (m + log Z)`` for kept tokens (``scaled_i >= threshold``) and -inf for
the rest, with m and Z the merged per-shard max and kept sum of exponentials that sampling
already computes (online-softmax merge, so a vocabulary-parallel sampler needs no full row).
Greedy rows are scaled by 1 and never filtered: they report the distribution at temperature 1,
whose argmax they emit. Under speculation an accepted draft reports p at its position, and a
correction token p too (the token's marginal law), never the draft's q nor the residual.

Prompt tokens (``echo`` with ``logprobs``) are scored by the model's own distribution: the raw
logits at temperature 1, without mask, bias, penalties or filters, which is what evaluation
harnesses that score a text by its log-likelihood expect; a request may ask for the same raw
distribution for its output tokens (``logprobs_mode: "raw"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from flare.sampler.top_tokens import TopTokens, ordered_top


@dataclass(frozen=True)
class TokenLogprobs:
    """Per slot: the emitted (or scored) token's log-probability and the top-k alternatives."""

    logprob: torch.Tensor
    """[...] float32: log p of the slot's token (-inf when p is 0)."""
    top_ids: torch.Tensor
    """[..., k] int64, most likely first (lower id first among ties)."""
    top_logprobs: torch.Tensor
    """[..., k] float32 (-inf past the kept tokens)."""

    def where_rows(self, pick: torch.Tensor, other: TokenLogprobs) -> TokenLogprobs:
        """``other`` on the rows ``pick`` [R] (bool) selects, this elsewhere ([R, slots] tensors)."""
        rows = pick.view(-1, 1)
        return TokenLogprobs(
            torch.where(rows, other.logprob, self.logprob),
            torch.where(rows.unsqueeze(2), other.top_ids, self.top_ids),
            torch.where(rows.unsqueeze(2), other.top_logprobs, self.top_logprobs),
        )


def log_normalizer(shard_max: torch.Tensor, shard_sumexp: torch.Tensor) -> torch.Tensor:
    """[N] m + log Z from per-shard [N, S] maxima and kept sums (online-softmax merge)."""
    position_max = shard_max.amax(1)
    merged = (shard_sumexp * torch.exp(shard_max - position_max.unsqueeze(1))).sum(1)
    return position_max + torch.log(merged)


def logprobs_at(
    kernels: ModuleType,
    scaled: torch.Tensor,
    threshold: torch.Tensor,
    log_z: torch.Tensor,
    slot_position: torch.Tensor,
    slot_token: torch.Tensor,
    num_top: int,
    num_shards: int,
) -> TokenLogprobs:
    """Log-probabilities of ``slot_token`` at ``slot_position`` (same shape; tokens < 0 read as
    token 0) and the ``num_top`` most likely tokens there, from ``scaled`` [N, V] with kept-set
    ``threshold`` [N] and normalizer ``log_z`` [N]."""
    token_logit = scaled[slot_position, slot_token.clamp(min=0)]
    return logprobs_of(
        token_logit, threshold, log_z, slot_position, kernels.shard_top_tokens(scaled, num_top, num_shards), num_top
    )


def logprobs_of(
    token_logit: torch.Tensor,
    threshold: torch.Tensor,
    log_z: torch.Tensor,
    slot_position: torch.Tensor,
    candidates: TopTokens,
    num_top: int,
) -> TokenLogprobs:
    """`logprobs_at` from its statistics: each slot token's logit, the positions' kept-set
    ``threshold`` and ``log_z`` [N], and the shards' top candidates [N, S * num_top] (what a
    vocabulary-parallel sampler gathers from its ranks instead of reading a full row)."""
    kept = token_logit >= threshold[slot_position]
    logprob = torch.where(kept, token_logit - log_z[slot_position], float("-inf"))
    top = ordered_top(candidates.values, candidates.ids, num_top)
    top_logprobs = torch.where(
        top.values >= threshold.unsqueeze(1), top.values - log_z.unsqueeze(1), float("-inf")
    )
    return TokenLogprobs(logprob, top.ids[slot_position], top_logprobs[slot_position])


def score_tokens(
    kernels: ModuleType,
    logits: torch.Tensor,
    targets: torch.Tensor,
    num_top: int,
    num_shards: int,
    positions: torch.Tensor | None = None,
) -> TokenLogprobs:
    """Log-probabilities of ``targets`` under the raw model distribution of ``logits`` [P, V]
    (temperature 1, nothing applied), and the ``num_top`` most likely tokens there: at each
    position in order ([P] targets), or at ``positions`` (same shape as ``targets``)."""
    num_positions = logits.shape[0]
    raw = logits.float()
    no_filter = torch.zeros(num_positions, dtype=torch.int64, device=logits.device)
    stats = kernels.distribution_statistics(
        raw,
        torch.arange(num_positions, device=logits.device),
        no_filter,
        torch.ones(num_positions, device=logits.device),
        torch.full((num_positions,), float("-inf"), device=logits.device),
        num_shards,
        filtered=False,
        max_top_k=0,
        any_top_p=False,
        need_sumexp=True,
        need_argmax=False,
    )
    assert stats.sumexp is not None
    return logprobs_at(
        kernels,
        raw,
        stats.threshold,
        log_normalizer(stats.max, stats.sumexp),
        torch.arange(num_positions, device=logits.device) if positions is None else positions,
        targets,
        num_top,
        num_shards,
    )
