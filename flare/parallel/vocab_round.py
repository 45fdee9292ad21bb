"""A round's verification and sampling with the vocabulary split across ranks.

Each rank holds the logits of its vocabulary shard (vocab_shard.py) and runs the existing torch
kernels on that slice: mask, logit_bias, penalties and temperature, then its shard's statistics.
Rank 0 gathers them and makes every decision with the merge of kernels/round.py, the same code
the in-process ``vocab_shards`` sampler runs on the same per-shard values, so a W-rank group
emits exactly the tokens, counts, statuses and log-probabilities of ``vocab_shards=W``:

1. every rank: per position its shard's max, sum of exp(logit - max), argmax, whether its raw
   logits hold a non-finite value; per draft the draft's logit and q when the draft is in the
   shard (-inf elsewhere: the max over ranks is the owner's value); with logprobs, its top-k.
   Rank 0 gathers them and decides acceptance, the sampled position and the greedy tokens;
2. with sampled rows: rank 0 broadcasts the accepted counts and the merged max and sum; every
   rank draws its Gumbel-max candidates (the noise of token i is the stream's at vocabulary
   index i, whichever rank holds it) and the residual's when q is general; rank 0 gathers them
   and picks the token;
3. with logprobs: rank 0 broadcasts the emitted tokens; each rank reports their logits where it
   holds them, and rank 0 computes the log-probabilities.

Decisions come only from gathered values: no rank assumes another computed the same thing.
Rows with a filter (top-k, top-p < 1, min-p > 0) get INVALID_SPECULATION as with in-process
shards; their fallback samples rank 0's copy of their first position (``gather_rows``) with the
single-shard sampler, which supports filters. Every rank calls these functions with the same
small inputs (broadcast with the round's plan) and its own slice of the logits; the others get
None back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.sampler import torch_backend as kernels
from flare.sampler.batch import SamplingBatch
from flare.sampler.gumbel_max import GumbelCandidates
from flare.sampler.logprobs import TokenLogprobs, log_normalizer, logprobs_of
from flare.sampler.penalties import PenaltyState
from flare.sampler.random_stream import Purpose, stream_key
from flare.sampler.round import (
    PositionLayout,
    SampledRound,
    RowKinds,
    _any_per_row,
    _merged_argmax,
    check_round_shapes,
    chosen_sample,
    emitted_tokens,
    position_layout,
    round_status,
    row_kinds,
    sampled_acceptance,
)
from flare.sampler.status import DeviceStatus
from flare.sampler.top_tokens import TopTokens
from flare.parallel.vocab_shard import (
    VocabShard,
    local_batch,
    local_ids,
    local_token_mask,
)
from flare.parallel.wire import broadcast_from_rank_0, gather_to_rank_0


def sample_round_across_ranks(
    shard: VocabShard,
    logits: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    token_mask: torch.Tensor | None = None,
    num_logprobs: int | None = None,
    raw_logprobs: torch.Tensor | None = None,
) -> SampledRound | None:
    """`kernels.round.sample_round` with ``vocab_shards`` = the group's size, each rank holding
    ``logits`` [N, width] of its shard (and ``draft_probs`` [R, Kmax, width], q's slice, or None
    on every rank); the other arguments are the whole round's, the same on every rank. Rank 0
    gets the result."""
    num_positions, width = logits.shape
    num_rows, max_drafts = draft_tokens.shape
    _check_shapes(shard, logits, num_drafts, draft_tokens, draft_probs, batch, token_mask)
    device = logits.device
    facts = batch.facts
    layout = position_layout(num_drafts, num_rows, max_drafts, num_positions, device)
    in_vocab = (draft_tokens >= 0) & (draft_tokens < shard.vocab_size)
    invalid_draft_token = (layout.is_draft & ~in_vocab).any(1)
    drafts = torch.where(layout.is_draft & in_vocab, draft_tokens, -1)
    own_drafts = local_ids(drafts, shard)
    kinds = row_kinds(batch)
    mine = local_batch(batch, shard)

    penalties = None
    if facts.any_penalized:
        assert mine.prompt_ids is not None and mine.output_ids is not None
        penalties = PenaltyState.from_ids(mine.prompt_ids, mine.output_ids, width)
    prepared = kernels.penalize_and_scale(
        logits,
        layout.row_of_position,
        layout.index_in_row,
        own_drafts,
        torch.where(kinds.sampled, batch.temperature, 1.0),
        torch.where(kinds.invalid_params, 1.0, batch.repetition_penalty),
        torch.where(kinds.invalid_params, 0.0, batch.presence_penalty),
        torch.where(kinds.invalid_params, 0.0, batch.frequency_penalty),
        penalties,
        scale=facts.any_temperature_scaling,
        token_mask=local_token_mask(token_mask, shard) if token_mask is not None else None,
        bias=mine.dense_bias(width),
    )
    scaled = prepared.scaled

    # Phase 1: the shard's statistics.
    need_sumexp = (facts.any_sampled and max_drafts > 0) or num_logprobs is not None
    shard_max, shard_sumexp, shard_argmax = _shard_statistics(scaled, need_sumexp)
    held = own_drafts >= 0
    draft_logit = torch.where(held, scaled[layout.draft_position, own_drafts.clamp(min=0)], float("-inf"))
    sent = [shard_max, shard_sumexp, shard_argmax + shard.start, prepared.nonfinite, draft_logit]
    if draft_probs is not None:
        own_q = draft_probs.gather(2, own_drafts.clamp(min=0).unsqueeze(2)).squeeze(2).float()
        sent.append(torch.where(held, own_q, float("-inf")))
    if num_logprobs is not None:
        sent += _top_candidates(scaled, num_logprobs, shard)
        if raw_logprobs is not None:
            raw = logits.float()
            sent += [*_shard_statistics(raw, True)[:2], *_top_candidates(raw, num_logprobs, shard)]
    gathered = _by_kind(gather_to_rank_0(sent, shard.group))

    merged_max = merged_sumexp = None
    decided = None
    if gathered is not None:
        stats_max, stats_sumexp = gathered[0], gathered[1]
        position_max = stats_max.amax(1)
        if need_sumexp:
            # Online-softmax merge: Z = sum_s Z_s exp(m_s - m).
            merged_sumexp = (stats_sumexp * torch.exp(stats_max - position_max.unsqueeze(1))).sum(1)
        merged_max = position_max
        q_draft = gathered[5].amax(1) if draft_probs is not None else None
        decided = _decide(
            layout, kinds, batch, drafts, gathered, position_max, merged_sumexp, q_draft, num_rows, max_drafts, device
        )

    # Phase 2: Gumbel-max candidates of the sampled position.
    token = None
    if facts.any_sampled:
        like = [((num_rows,), torch.int64), ((num_positions,), torch.float32), ((num_positions,), torch.float32)]
        shared = broadcast_from_rank_0(
            [decided.num_accepted, merged_max, merged_sumexp if merged_sumexp is not None else torch.ones(num_positions)]
            if decided is not None
            else None,
            like,
            shard.group,
        )
        num_accepted = shared[0].to(device)
        position_max, sumexp = shared[1].to(device), shared[2].to(device)
        candidates = _shard_candidates(
            shard, scaled, layout, batch, drafts, draft_probs, num_accepted, position_max, sumexp
        )
        parts = gather_to_rank_0(candidates, shard.group)
        if decided is not None:
            assert parts is not None
            columns = [torch.stack([part[i] for part in parts], 1) for i in range(len(candidates))]
            rejected = num_accepted < layout.num_drafts
            residual = columns[2:] if draft_probs is not None else [None, None, None]
            token = chosen_sample(GumbelCandidates(columns[0], columns[1], *residual), rejected)

    tokens = status = None
    if decided is not None:
        if token is None:
            token = torch.zeros(num_rows, dtype=torch.int64, device=device)
        if decided.argmax is not None:
            token = torch.where(kinds.greedy, decided.argmax[decided.sample_position], token)
        status = round_status(
            decided.empty_row,
            decided.nonfinite_row,
            decided.invalid_draft_prob,
            invalid_draft_token,
            kinds.filtered & (shard.world_size > 1),
            kinds.invalid_params,
        )
        tokens = emitted_tokens(drafts, decided.num_accepted, token, status == int(DeviceStatus.OK))

    # Phase 3: the emitted tokens' logits, where each lies.
    logprobs = None
    if num_logprobs is not None:
        tokens_everywhere = broadcast_from_rank_0(
            [tokens] if tokens is not None else None, [((num_rows, max_drafts + 1), torch.int64)], shard.group
        )[0].to(device)
        slot = torch.arange(max_drafts + 1, device=device).unsqueeze(0)
        slot_position = (layout.row_start.unsqueeze(1) + slot).clamp(max=num_positions - 1)
        own_tokens = local_ids(tokens_everywhere.clamp(min=0), shard)
        token_logits = [_held_logit(scaled, slot_position, own_tokens)]
        if raw_logprobs is not None:
            token_logits.append(_held_logit(logits.float(), slot_position, own_tokens))
        parts = gather_to_rank_0(token_logits, shard.group)
        if gathered is not None:
            assert parts is not None and decided is not None
            logit_of = [torch.stack([part[i] for part in parts], 0).amax(0) for i in range(len(token_logits))]
            first_top = 6 if draft_probs is not None else 5
            no_threshold = torch.full((num_positions,), float("-inf"), device=device)
            logprobs = logprobs_of(
                logit_of[0],
                no_threshold,
                log_normalizer(gathered[0], gathered[1]),
                slot_position,
                _merged_top(gathered[first_top], gathered[first_top + 1]),
                num_logprobs,
            )
            if raw_logprobs is not None:
                raw_logprobs_of = logprobs_of(
                    logit_of[1],
                    no_threshold,
                    log_normalizer(gathered[first_top + 2], gathered[first_top + 3]),
                    slot_position,
                    _merged_top(gathered[first_top + 4], gathered[first_top + 5]),
                    num_logprobs,
                )
                logprobs = logprobs.where_rows(raw_logprobs.to(device), raw_logprobs_of)

    if decided is None:
        return None
    assert tokens is not None and status is not None
    ok = status == int(DeviceStatus.OK)
    return SampledRound(
        tokens=tokens,
        num_emitted=torch.where(ok, decided.num_accepted + 1, 0).to(torch.int32),
        status=status.to(torch.int32),
        logprobs=logprobs,
    )


def score_tokens_across_ranks(
    shard: VocabShard, logits: torch.Tensor, targets: torch.Tensor, num_top: int
) -> TokenLogprobs | None:
    """`kernels.round.score_tokens` (echo: a prompt's tokens under the raw distribution) with
    ``logits`` [P, width] this rank's shard; one gather. Rank 0 gets the result."""
    positions = torch.arange(logits.shape[0], device=logits.device)
    raw = logits.float()
    own_targets = local_ids(targets.clamp(min=0), shard)
    sent = [*_shard_statistics(raw, True)[:2], *_top_candidates(raw, num_top, shard), _held_logit(raw, positions, own_targets)]
    gathered = _by_kind(gather_to_rank_0(sent, shard.group))
    if gathered is None:
        return None
    return logprobs_of(
        gathered[4].amax(1),
        torch.full((logits.shape[0],), float("-inf"), device=logits.device),
        log_normalizer(gathered[0], gathered[1]),
        positions,
        _merged_top(gathered[2], gathered[3]),
        num_top,
    )


def gather_rows(shard: VocabShard, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """Rank 0 gets the full [len(positions), V] rows of ``positions`` (the fallback of rows that
    got INVALID_SPECULATION: a few rows, sampled with filters by the single-shard sampler)."""
    rows = logits.index_select(0, positions.to(logits.device)).float()
    padded = torch.nn.functional.pad(rows, (0, shard.padded_width - shard.width), value=float("nan"))
    parts = gather_to_rank_0([padded], shard.group)
    if parts is None:
        return None
    return torch.cat([part[0] for part in parts], 1)[:, : shard.vocab_size]


@dataclass(frozen=True)
class _Decided:
    """Rank 0's decisions of phase 1."""

    num_accepted: torch.Tensor
    sample_position: torch.Tensor
    argmax: torch.Tensor | None
    empty_row: torch.Tensor
    nonfinite_row: torch.Tensor
    invalid_draft_prob: torch.Tensor


def _decide(
    layout: PositionLayout,
    kinds: RowKinds,
    batch: SamplingBatch,
    drafts: torch.Tensor,
    gathered: list[torch.Tensor],
    position_max: torch.Tensor,
    sumexp: torch.Tensor | None,
    q_draft: torch.Tensor | None,
    num_rows: int,
    max_drafts: int,
    device: torch.device,
) -> _Decided:
    """Acceptance, the sampled position and the greedy tokens from the gathered statistics,
    as kernels/round.py decides them."""
    facts = batch.facts
    stats_max, stats_argmax, nonfinite, draft_logit = gathered[0], gathered[2], gathered[3], gathered[4]
    empty_position = ~torch.isfinite(position_max)
    nonfinite_row = _any_per_row(nonfinite.bool().any(1), layout.row_of_position, num_rows)
    empty_row = _any_per_row(empty_position, layout.row_of_position, num_rows)
    accept = torch.zeros(num_rows, max_drafts, dtype=torch.bool, device=device)
    invalid_draft_prob = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if q_draft is not None:
        invalid_draft_prob = (layout.is_draft & ~((q_draft > 0) & (q_draft <= 1))).any(1)
    argmax = None
    if facts.any_greedy:
        argmax = _merged_argmax(stats_max, stats_argmax.to(torch.int64))
        accept = torch.where(kinds.greedy.unsqueeze(1), drafts == argmax[layout.draft_position], accept)
    if facts.any_sampled and max_drafts > 0:
        assert sumexp is not None
        draft_position = layout.draft_position
        accepted_sampled = sampled_acceptance(
            draft_logit.amax(1),
            torch.full_like(position_max, float("-inf"))[draft_position],
            position_max[draft_position],
            sumexp[draft_position],
            q_draft,
            batch,
            layout.draft_index,
        )
        accept = torch.where(kinds.sampled.unsqueeze(1), accepted_sampled, accept)
    accept &= layout.is_draft
    num_accepted = accept.to(torch.int64).cumprod(1).sum(1)
    return _Decided(
        num_accepted=num_accepted,
        sample_position=layout.row_start + num_accepted,
        argmax=argmax,
        empty_row=empty_row,
        nonfinite_row=nonfinite_row,
        invalid_draft_prob=invalid_draft_prob,
    )


def _shard_statistics(scaled: torch.Tensor, need_sumexp: bool) -> list[torch.Tensor]:
    """Max, sum of exp(x - max) and argmax of each position over the shard: the operations of
    `distribution_statistics` for one of several shards, so the values are the same bits."""
    shard_max = scaled.amax(dim=-1)
    if need_sumexp:
        # A shard a token mask empties (max -inf) holds no mass, not exp(-inf + inf) = NaN.
        shard_sum = torch.sub(scaled, shard_max.unsqueeze(1)).exp_().sum(-1)
        sumexp = torch.where(shard_max > float("-inf"), shard_sum, 0.0)
    else:
        sumexp = torch.zeros_like(shard_max)
    return [shard_max, sumexp, scaled.argmax(dim=-1)]


def _top_candidates(scaled: torch.Tensor, k: int, shard: VocabShard) -> list[torch.Tensor]:
    top = kernels.shard_top_tokens(scaled, k, 1)
    return [top.values, torch.where(top.ids >= 0, top.ids + shard.start, -1)]


def _merged_top(values: torch.Tensor, ids: torch.Tensor) -> TopTokens:
    """[N, W, k] gathered candidates as the [N, W * k] of in-process shards, shard by shard."""
    return TopTokens(values.flatten(1), ids.to(torch.int64).flatten(1))


def _held_logit(scaled: torch.Tensor, position: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The logit at (position, column) where this shard holds the token, -inf elsewhere."""
    return torch.where(own >= 0, scaled[position, own.clamp(min=0)], float("-inf"))


def _shard_candidates(
    shard: VocabShard,
    scaled: torch.Tensor,
    layout: PositionLayout,
    batch: SamplingBatch,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_accepted: torch.Tensor,
    position_max: torch.Tensor,
    sumexp: torch.Tensor,
) -> list[torch.Tensor]:
    """This shard's Gumbel-max candidates of every row's sampled position (as round.py's
    `_sample` asks the kernel for them), [R] each."""
    num_rows, max_drafts = drafts.shape
    sample_position = layout.row_start + num_accepted
    rejected = num_accepted < layout.num_drafts
    key = stream_key(batch.seed, batch.first_position + num_accepted, Purpose.SAMPLE)
    exclude = torch.full((num_rows,), -1, dtype=torch.int64, device=scaled.device)
    draft_q = None
    if max_drafts > 0:
        at_rejection = num_accepted.clamp(max=max_drafts - 1)
        if draft_probs is None:
            rejected_token = drafts.gather(1, at_rejection.unsqueeze(1)).squeeze(1)
            exclude = local_ids(torch.where(rejected, rejected_token, -1), shard)
        else:
            draft_q = draft_probs[torch.arange(num_rows, device=scaled.device), at_rejection].float()
    candidates = kernels.gumbel_candidates(
        scaled,
        sample_position,
        key,
        position_max[sample_position],
        sumexp[sample_position],
        torch.full((num_rows,), float("-inf"), device=scaled.device),
        exclude,
        draft_q,
        1,
        first_index=shard.start,
    )
    out = [candidates.index[:, 0], candidates.value[:, 0]]
    if draft_q is not None:
        assert candidates.residual_index is not None and candidates.residual_value is not None
        assert candidates.residual_mass is not None
        out += [candidates.residual_index[:, 0], candidates.residual_value[:, 0], candidates.residual_mass[:, 0]]
    return out


def _by_kind(parts: list[list[torch.Tensor]] | None) -> list[torch.Tensor] | None:
    """Rank by rank lists of tensors -> per tensor, the ranks stacked on dimension 1."""
    if parts is None:
        return None
    return [torch.stack([part[i] for part in parts], 1) for i in range(len(parts[0]))]


def _check_shapes(
    shard: VocabShard,
    logits: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    token_mask: torch.Tensor | None,
) -> None:
    num_positions, width = logits.shape
    if width != shard.width:
        raise ValueError(f"sample_round_across_ranks: rank {shard.rank} holds {shard.width} tokens, the logits {width}")
    check_round_shapes(
        "sample_round_across_ranks", num_positions, shard.vocab_size, width, num_drafts, draft_tokens, draft_probs, batch, token_mask
    )
