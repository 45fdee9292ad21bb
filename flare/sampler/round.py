"""sample_round: one round's sampling, conducted once, whether one process holds the whole
vocabulary or each rank holds a shard of it (the `ShardReduction`, shards.py).

Row r of a round owns ``num_drafts[r] + 1`` consecutive positions of the flat logits
(round_inputs.py). Per round, with no host synchronisation:

1. penalties and temperature (`penalized_logits`): a grammar's token mask, the rows' logit_bias,
   repetition, frequency and presence penalties, then the temperature, on the columns this
   process holds; every later step sees these logits, so drafts are verified against the same
   constrained p that non-speculative sampling draws from;
2. distribution statistics (distribution.py): per shard the max, the kept sum of exponentials
   and the argmax, with top-k / top-p / min-p when one shard holds the whole vocabulary; the
   decider merges them (shards.py);
3. verification (verification.py): greedy rows accept a draft iff it is the argmax; sampled rows
   by rejection sampling, min(1, p(x) / q(x));
4. the draw (gumbel_max.py): the correction from the residual max(p - q, 0) after a rejection,
   else the bonus token from p, by Gumbel-max argmax_i(log p_i + G_i) per shard, merged;
5. statuses (`round_status`, the codes of status.py) and the emitted tokens;
6. with ``num_logprobs``, log-probabilities of every emitted token and of the most likely tokens
   at its position (logprobs.py).

Each process computes its shards' contributions; the reduction gathers them to the decider
(rank 0 across ranks; the process itself otherwise) and shares the decider's choices back, so
a W-rank group and ``LocalShards(W)`` emit the same bits. A row with K = 0 drafts is plain
sampling through the same path. Rounds of greedy rows alone take a short path with the same
results: the C kernel greedy_tokens.c on the CPU, its torch twin `greedy_round` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from flare.sampler import native_sampler as native
from flare.sampler.batch import SamplingBatch
from flare.sampler.gumbel_max import GumbelCandidates
from flare.sampler.logprobs import TokenLogprobs, log_normalizer, logprobs_of
from flare.sampler.penalties import PenaltyState, PreparedLogits
from flare.sampler.round_inputs import (
    PositionLayout,
    RowFilters,
    RowKinds,
    any_per_row,
    check_round_shapes,
    no_filters,
    position_layout,
    row_filters,
    row_kinds,
    slot_positions,
    usable_drafts,
)
from flare.sampler.shards import LocalShards, ShardReduction, held_values, merged_argmax, merged_sumexp
from flare.sampler.status import DeviceStatus
from flare.sampler.top_tokens import TopTokens
from flare.sampler.verification import (
    accepted_counts,
    emitted_tokens,
    greedy_acceptance,
    rejection_acceptance,
    round_status,
    sampled_token,
    token_draw,
)

ONE_PROCESS = LocalShards()
"""The whole vocabulary in this process, as one shard, on the logits' device's backend."""


@dataclass(frozen=True)
class SampledRound:
    """What one round produced, on the logits' device; read back once per round."""

    tokens: torch.Tensor
    """[R, Kmax + 1] int64: accepted drafts then the correction or bonus token, -1 padded."""
    num_emitted: torch.Tensor
    """[R] int32: accepted drafts + 1; 0 when the row's status is not OK."""
    status: torch.Tensor
    """[R] int32: a DeviceStatus code per row."""
    logprobs: TokenLogprobs | None = None
    """With num_logprobs: per slot of ``tokens``, [R, Kmax + 1] and [R, Kmax + 1, k]."""


def sample_round(
    logits: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    shards: ShardReduction = ONE_PROCESS,
    *,
    token_mask: torch.Tensor | None = None,
    num_logprobs: int | None = None,
    raw_logprobs: torch.Tensor | None = None,
) -> SampledRound | None:
    """Verify and sample every row of a round; the decider gets the result, any other process
    of ``shards`` None.

    logits: [N, width], the rows' positions in order (row r has num_drafts[r] + 1 of them), over
    the vocabulary columns this process holds (all V of them with `LocalShards`).
    num_drafts: [R] integer. draft_tokens: [R, Kmax] int64, -1 past a row's drafts.
    draft_probs: [R, Kmax, width] draft distributions q over the held columns, or None for
    deterministic drafters (q is one-hot on the proposed token).
    shards: where the vocabulary's shards are; with more than one, a sampled row with a filter
    gets INVALID_SPECULATION.
    token_mask: [N, ceil(V / 32)] int32 allowed-token bitmask per position, or None (no grammar).
    num_logprobs: None, or k >= 0: also report log p of each emitted token and the k most
    likely tokens at its position.
    raw_logprobs: [R] bool, or None: rows that report the raw model distribution (temperature
    1, nothing applied) instead of the one sampled from; costs one more statistics pass.
    The other arguments than logits and draft_probs are the whole round's, the same on every
    process.
    """
    num_positions, width = logits.shape
    num_rows, max_drafts = draft_tokens.shape
    vocab_size = shards.vocab_size(width)
    check_round_shapes(num_positions, vocab_size, width, num_drafts, draft_tokens, draft_probs, batch, token_mask)
    facts = batch.facts
    device = logits.device
    kernels = shards.kernels(device)
    greedy_only = not facts.any_sampled and token_mask is None and num_logprobs is None and raw_logprobs is None
    if greedy_only and shards.whole_vocabulary:
        if draft_probs is None and device.type == "cpu" and native.available():
            return SampledRound(
                *native.greedy_tokens(
                    logits.float().contiguous(), num_drafts.to(torch.int64).contiguous(), draft_tokens.to(torch.int64).contiguous(), batch
                )
            )
        if num_positions == num_rows:
            return SampledRound(*greedy_round(logits, batch, max_drafts, kernels))

    # A round of one position a row has no draft in any row, whatever draft_tokens' width: the
    # verification's statistics and draws are skipped (they would accept nothing).
    drafting = num_positions > num_rows
    layout = position_layout(num_drafts, num_rows, max_drafts, num_positions, device)
    drafts = usable_drafts(draft_tokens, layout, vocab_size)
    kinds = row_kinds(batch)
    own_drafts = shards.own_ids(drafts.tokens)
    prepared = penalized_logits(
        kernels,
        logits,
        layout,
        own_drafts,
        kinds,
        shards.own_batch(batch),
        shards.own_token_mask(token_mask) if token_mask is not None else None,
    )
    scaled = prepared.scaled
    statistics = gather_statistics(
        shards,
        kernels,
        prepared,
        logits,
        layout,
        own_drafts,
        draft_probs,
        row_filters(batch, kinds, shards.applies_filters),
        # Gumbel-max needs no normalisation: Z only serves p(draft), the residual and logprobs.
        need_sumexp=(facts.any_sampled and drafting) or num_logprobs is not None,
        need_argmax=facts.any_greedy,
        num_logprobs=num_logprobs,
        raw_logprobs=raw_logprobs,
    )
    verdict = None
    if statistics.gathered is not None:
        verdict = verify_drafts(statistics.gathered, statistics.threshold, layout, kinds, drafts.tokens, batch, drafting)
    token = None
    if facts.any_sampled:
        token = draw_tokens(shards, kernels, scaled, statistics.threshold, verdict, layout, drafts.tokens, draft_probs, batch)

    tokens = status = None
    if verdict is not None:
        if token is None:
            token = torch.zeros(num_rows, dtype=torch.int64, device=device)
        if verdict.argmax is not None:
            token = torch.where(kinds.greedy, verdict.argmax[verdict.sample_position], token)
        status = round_status(
            verdict.empty_row,
            verdict.nonfinite_row,
            verdict.invalid_draft_prob,
            drafts.invalid_token,
            kinds.filtered & (shards.num_shards > 1),
            kinds.invalid_params,
        )
        tokens = emitted_tokens(drafts.tokens, verdict.num_accepted, token, status == int(DeviceStatus.OK))
    logprobs = None
    if num_logprobs is not None:
        logprobs = emitted_logprobs(shards, statistics, scaled, logits, layout, tokens, num_logprobs, raw_logprobs)

    if verdict is None:
        return None
    assert tokens is not None and status is not None
    ok = status == int(DeviceStatus.OK)
    return SampledRound(
        tokens=tokens,
        num_emitted=torch.where(ok, verdict.num_accepted + 1, 0).to(torch.int32),
        status=status.to(torch.int32),
        logprobs=logprobs,
    )


def penalized_logits(
    kernels: ModuleType,
    logits: torch.Tensor,
    layout: PositionLayout,
    own_drafts: torch.Tensor,
    kinds: RowKinds,
    own_batch: SamplingBatch,
    own_token_mask: torch.Tensor | None,
) -> PreparedLogits:
    """The logits each position samples from, on this process's columns, in this order: the
    grammar's mask (-inf on disallowed tokens), x += logit_bias, repetition penalty (x / rep
    when x > 0 else x * rep, on tokens seen in the prompt or output), x -= freq * count +
    pres * [count > 0] over the output (a verify position's earlier drafts counting as output),
    then x / temperature (greedy and invalid rows by 1). Invalid rows get neutral penalties; the
    raw logits' non-finite check comes with them (penalties.py)."""
    width = logits.shape[1]
    penalties = None
    if own_batch.facts.any_penalized:
        assert own_batch.prompt_ids is not None and own_batch.output_ids is not None
        penalties = PenaltyState.from_ids(own_batch.prompt_ids, own_batch.output_ids, width)
    return kernels.penalize_and_scale(
        logits,
        layout.row_of_position,
        layout.index_in_row,
        own_drafts,
        torch.where(kinds.sampled, own_batch.temperature, 1.0),
        torch.where(kinds.invalid_params, 1.0, own_batch.repetition_penalty),
        torch.where(kinds.invalid_params, 0.0, own_batch.presence_penalty),
        torch.where(kinds.invalid_params, 0.0, own_batch.frequency_penalty),
        penalties,
        scale=own_batch.facts.any_temperature_scaling,
        token_mask=own_token_mask,
        bias=own_batch.dense_bias(width),
    )


@dataclass(frozen=True)
class RoundStatistics:
    """Phase 1 of a round: what this process applied, and at the decider what every shard sent."""

    threshold: torch.Tensor
    """[N]: the kept-set threshold of this process's filters (-inf: all kept)."""
    raw_threshold: torch.Tensor | None
    """[N]: the same for the raw distribution, when some row reports raw log-probabilities."""
    gathered: dict[str, torch.Tensor] | None
    """At the decider: per name, every shard's contribution on the last dimension."""


def gather_statistics(
    shards: ShardReduction,
    kernels: ModuleType,
    prepared: PreparedLogits,
    logits: torch.Tensor,
    layout: PositionLayout,
    own_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    filters: RowFilters,
    need_sumexp: bool,
    need_argmax: bool,
    num_logprobs: int | None,
    raw_logprobs: torch.Tensor | None,
) -> RoundStatistics:
    """This process's per-shard statistics, gathered to the decider in one step: per position
    each shard's max m_s, kept sum Z_s = sum exp(x - m_s) and argmax, and the raw logits'
    non-finite flag; per draft its logit and q where this process holds it (-inf elsewhere);
    with logprobs each shard's top-k, and for raw rows the same over the unprocessed logits."""
    scaled = prepared.scaled
    num_positions = scaled.shape[0]
    device = scaled.device
    stats = shards.shard_statistics(
        kernels, scaled, layout.row_of_position, filters, need_sumexp=need_sumexp, need_argmax=need_argmax
    )
    sent = {
        "max": stats.max,
        "nonfinite": prepared.nonfinite.unsqueeze(-1),
        "draft_logit": held_values(scaled, layout.draft_position, own_drafts).unsqueeze(-1),
    }
    if stats.sumexp is not None:
        sent["sumexp"] = stats.sumexp
    if stats.argmax is not None:
        sent["argmax"] = stats.argmax
    if draft_probs is not None:
        held = own_drafts >= 0
        own_q = draft_probs.gather(2, own_drafts.clamp(min=0).unsqueeze(2)).squeeze(2).float()
        sent["q_draft"] = torch.where(held, own_q, float("-inf")).unsqueeze(-1)
    raw_threshold = None
    if num_logprobs is not None:
        sent["top_values"], sent["top_ids"] = own_top_tokens(shards, kernels, scaled, num_logprobs)
        if raw_logprobs is not None:
            raw = logits.float()
            raw_stats = shards.shard_statistics(
                kernels,
                raw,
                torch.arange(num_positions, device=device),
                no_filters(num_positions, device),
                need_sumexp=True,
                need_argmax=False,
            )
            assert raw_stats.sumexp is not None
            raw_threshold = raw_stats.threshold
            sent["raw_max"], sent["raw_sumexp"] = raw_stats.max, raw_stats.sumexp
            sent["raw_top_values"], sent["raw_top_ids"] = own_top_tokens(shards, kernels, raw, num_logprobs)
    gathered = shards.gather(list(sent.values()))
    return RoundStatistics(
        threshold=stats.threshold,
        raw_threshold=raw_threshold,
        gathered=dict(zip(sent, gathered)) if gathered is not None else None,
    )


def own_top_tokens(shards: ShardReduction, kernels: ModuleType, values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, held shards * k]: each held shard's k largest ``values`` (largest first, lower id
    first among ties) and their vocabulary ids (-1 padding), for the decider's merge."""
    top = kernels.shard_top_tokens(values, k, shards.held_shards)
    return top.values, torch.where(top.ids >= 0, top.ids + shards.first_index, -1)


@dataclass(frozen=True)
class Verdict:
    """The decider's verification of a round, from the gathered statistics."""

    num_accepted: torch.Tensor
    """[R] int64: drafts accepted before the first rejection."""
    sample_position: torch.Tensor
    """[R]: the position sampled after them."""
    argmax: torch.Tensor | None
    """[N]: the merged argmax of every position, when some row is greedy."""
    position_max: torch.Tensor
    """[N]: the merged max m."""
    sumexp_or_ones: torch.Tensor
    """[N]: the merged Z where computed, else 1 (Gumbel-max without a residual needs no Z)."""
    empty_row: torch.Tensor
    nonfinite_row: torch.Tensor
    invalid_draft_prob: torch.Tensor


def verify_drafts(
    gathered: dict[str, torch.Tensor],
    threshold: torch.Tensor,
    layout: PositionLayout,
    kinds: RowKinds,
    drafts: torch.Tensor,
    batch: SamplingBatch,
    drafting: bool,
) -> Verdict:
    """Acceptance of every row's drafts from the shards' merged statistics (``gathered``: per
    shard [N, S] ``max``, ``sumexp``, ``argmax``; per process ``nonfinite``, ``draft_logit``,
    ``q_draft`` on the last dimension): greedy rows accept x_j iff x_j = argmax p_j, sampled rows
    with probability min(1, p_j(x_j) / q_j(x_j)). A position whose merged max is not finite makes
    its row EMPTY_DISTRIBUTION; a drafter's q(x) outside (0, 1] makes it
    INVALID_DRAFT_PROBABILITY, whatever the row's sampling."""
    num_rows, max_drafts = drafts.shape
    facts = batch.facts
    device = drafts.device
    shard_max = gathered["max"]
    position_max = shard_max.amax(1)
    empty_row = any_per_row(~torch.isfinite(position_max), layout.row_of_position, num_rows)
    nonfinite_row = any_per_row(gathered["nonfinite"].bool().any(-1), layout.row_of_position, num_rows)
    accept = torch.zeros(num_rows, max_drafts, dtype=torch.bool, device=device)
    q_draft = None
    invalid_draft_prob = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if "q_draft" in gathered:
        q_draft = gathered["q_draft"].amax(-1)
        invalid_draft_prob = (layout.is_draft & ~((q_draft > 0) & (q_draft <= 1))).any(1)
    argmax = None
    if facts.any_greedy:
        argmax = merged_argmax(shard_max, gathered["argmax"].to(torch.int64))
        accept = torch.where(kinds.greedy.unsqueeze(1), greedy_acceptance(drafts, argmax, layout.draft_position), accept)
    sumexp = merged_sumexp(shard_max, gathered["sumexp"]) if "sumexp" in gathered else None
    if facts.any_sampled and drafting:
        assert sumexp is not None
        at = layout.draft_position
        accepted_sampled = rejection_acceptance(
            gathered["draft_logit"].amax(-1), threshold[at], position_max[at], sumexp[at], q_draft, batch, layout.draft_index
        )
        accept = torch.where(kinds.sampled.unsqueeze(1), accepted_sampled, accept)
    num_accepted = accepted_counts(accept, layout.is_draft)
    return Verdict(
        num_accepted=num_accepted,
        sample_position=layout.row_start + num_accepted,
        argmax=argmax,
        position_max=position_max,
        sumexp_or_ones=sumexp if sumexp is not None else torch.ones_like(position_max),
        empty_row=empty_row,
        nonfinite_row=nonfinite_row,
        invalid_draft_prob=invalid_draft_prob,
    )


def draw_tokens(
    shards: ShardReduction,
    kernels: ModuleType,
    scaled: torch.Tensor,
    threshold: torch.Tensor,
    verdict: Verdict | None,
    layout: PositionLayout,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
) -> torch.Tensor | None:
    """At the decider, [R]: every row's correction or bonus token by Gumbel-max,
    argmax_i(log p_i + G_i), from the residual max(p - q, 0) after a rejection. The decider
    shares its accepted counts and merged m and Z; every process draws its shards' candidates at
    the sampled positions (the noise of token i is the stream's at vocabulary index i, whoever
    holds it); the decider merges them. None on the other processes."""
    num_rows, num_positions = drafts.shape[0], scaled.shape[0]
    num_accepted, position_max, sumexp = shards.share(
        [verdict.num_accepted, verdict.position_max, verdict.sumexp_or_ones] if verdict is not None else None,
        [((num_rows,), torch.int64), ((num_positions,), torch.float32), ((num_positions,), torch.float32)],
        scaled.device,
    )
    draw = token_draw(batch, layout.row_start, drafts, draft_probs, layout.num_drafts, num_accepted)
    at = draw.sample_position
    candidates = kernels.gumbel_candidates(
        scaled,
        at,
        draw.key,
        position_max[at],
        sumexp[at],
        threshold[at],
        shards.own_ids(draw.exclude),
        draw.draft_q,
        shards.held_shards,
        first_index=shards.first_index,
    )
    parts = [candidates.index, candidates.value]
    if draw.draft_q is not None:
        assert candidates.residual_index is not None and candidates.residual_value is not None
        assert candidates.residual_mass is not None
        parts += [candidates.residual_index, candidates.residual_value, candidates.residual_mass]
    merged = shards.gather(parts)
    if merged is None:
        return None
    residual = merged[2:] if draw.draft_q is not None else [None, None, None]
    return sampled_token(GumbelCandidates(merged[0], merged[1], *residual), draw.rejected)


def emitted_logprobs(
    shards: ShardReduction,
    statistics: RoundStatistics,
    scaled: torch.Tensor,
    logits: torch.Tensor,
    layout: PositionLayout,
    tokens: torch.Tensor | None,
    num_logprobs: int,
    raw_logprobs: torch.Tensor | None,
) -> TokenLogprobs | None:
    """At the decider: log p of every emitted token, log p_i = x_i - (m + log Z) on the kept
    set, and the ``num_logprobs`` most likely tokens at its position; for the ``raw_logprobs``
    rows, of the raw distribution instead. The decider shares the tokens; every process reports
    their logits where it holds them. None on the other processes."""
    num_positions = scaled.shape[0]
    num_rows, max_drafts = layout.is_draft.shape
    shared_tokens = shards.share([tokens] if tokens is not None else None, [((num_rows, max_drafts + 1), torch.int64)], scaled.device)[0]
    slot_position = slot_positions(layout, max_drafts, num_positions)
    own_tokens = shards.own_ids(shared_tokens.clamp(min=0))
    token_logits = [held_values(scaled, slot_position, own_tokens).unsqueeze(-1)]
    if raw_logprobs is not None:
        token_logits.append(held_values(logits.float(), slot_position, own_tokens).unsqueeze(-1))
    merged = shards.gather(token_logits)
    if merged is None:
        return None
    gathered = statistics.gathered
    assert gathered is not None
    logprobs = logprobs_of(
        merged[0].amax(-1),
        statistics.threshold,
        log_normalizer(gathered["max"], gathered["sumexp"]),
        slot_position,
        TopTokens(gathered["top_values"], gathered["top_ids"].to(torch.int64)),
        num_logprobs,
    )
    if raw_logprobs is None:
        return logprobs
    assert statistics.raw_threshold is not None
    raw = logprobs_of(
        merged[1].amax(-1),
        statistics.raw_threshold,
        log_normalizer(gathered["raw_max"], gathered["raw_sumexp"]),
        slot_position,
        TopTokens(gathered["raw_top_values"], gathered["raw_top_ids"].to(torch.int64)),
        num_logprobs,
    )
    return logprobs.where_rows(raw_logprobs.to(scaled.device), raw)


def score_tokens(
    logits: torch.Tensor, targets: torch.Tensor, num_top: int, shards: ShardReduction = ONE_PROCESS
) -> TokenLogprobs | None:
    """log p(target) under the raw model distribution (temperature 1, nothing applied),
    log p_i = x_i - (m + log Z), of ``targets`` [P] at each position of ``logits`` [P, width]
    (the held columns), with the ``num_top`` most likely tokens (scoring a prompt: echo). The
    decider gets the result, any other process of ``shards`` None."""
    num_positions, width = logits.shape
    shards.vocab_size(width)
    device = logits.device
    kernels = shards.kernels(device)
    positions = torch.arange(num_positions, device=device)
    raw = logits.float()
    stats = shards.shard_statistics(kernels, raw, positions, no_filters(num_positions, device), need_sumexp=True, need_argmax=False)
    assert stats.sumexp is not None
    top_values, top_ids = own_top_tokens(shards, kernels, raw, num_top)
    target_logit = held_values(raw, positions, shards.own_ids(targets.clamp(min=0)))
    gathered = shards.gather([stats.max, stats.sumexp, top_values, top_ids, target_logit.unsqueeze(-1)])
    if gathered is None:
        return None
    return logprobs_of(
        gathered[4].amax(-1),
        stats.threshold,
        log_normalizer(gathered[0], gathered[1]),
        positions,
        TopTokens(gathered[2], gathered[3].to(torch.int64)),
        num_top,
    )


def greedy_round(
    logits: torch.Tensor, batch: SamplingBatch, max_drafts: int, kernels: ModuleType
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The round's short path off the CPU kernel: tokens [R, max_drafts + 1] int64 (the argmax,
    then -1), emitted [R] int32 and status [R] int32 of a round of greedy or invalid rows with
    one position each, without token mask or log-probabilities: sample_round's results in a few
    dozen operators instead of the general path's few hundred, which at one row cost more to
    dispatch than to compute. Each row emits argmax_i x_i of its logits after its logit bias
    and penalties (the lowest index on ties, as the shards' merge gives); on the CPU
    `native.greedy_tokens` (greedy_tokens.c) computes the same in one call, drafts included.

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
