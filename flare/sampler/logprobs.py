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

import torch

from flare.sampler.shards import merged_sumexp
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
    return shard_max.amax(1) + torch.log(merged_sumexp(shard_max, shard_sumexp))


def logprobs_of(
    token_logit: torch.Tensor,
    threshold: torch.Tensor,
    log_z: torch.Tensor,
    slot_position: torch.Tensor,
    candidates: TopTokens,
    num_top: int,
) -> TokenLogprobs:
    """Per slot, log p of its token and the ``num_top`` most likely tokens at ``slot_position``,
    from the statistics the shards merge: each slot token's logit, the positions' kept-set
    ``threshold`` and ``log_z`` = m + log Z [N], and the shards' top candidates [N, S * num_top]
    (no full row is read): log p_i = x_i - log_z on kept tokens (x_i >= threshold), -inf
    elsewhere."""
    kept = token_logit >= threshold[slot_position]
    logprob = torch.where(kept, token_logit - log_z[slot_position], float("-inf"))
    top = ordered_top(candidates.values, candidates.ids, num_top)
    top_logprobs = torch.where(
        top.values >= threshold.unsqueeze(1), top.values - log_z.unsqueeze(1), float("-inf")
    )
    return TokenLogprobs(logprob, top.ids[slot_position], top_logprobs[slot_position])
