"""sample_round: penalties, temperature, filters, seeded sampling and speculative verification
for every row of a round, in one call with no host synchronisation.

Row r of a round owns ``num_drafts[r] + 1`` consecutive positions of the flat logits: position j
is the target's prediction after the row's last accepted token and its first j drafts. Per row:

- drafts are verified in order by speculative rejection sampling (Leviathan et al. 2023,
  Chen et al. 2023): draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)), drawn as
  ``u * q < p`` with u from the row's stream (seed, output position, ACCEPT);
- at the first rejection the token at that position is sampled from normalize(max(p_j - q_j, 0));
  when every draft is accepted a bonus token is sampled from p at the last position. Either way
  the sample is Gumbel-max with the stream (seed, output position, SAMPLE);
- greedy rows (temperature 0) accept a draft iff it is the argmax and emit the argmax;
- a row with K = 0 drafts is plain sampling through the same path.

Before penalties and temperature, a grammar's token mask (per position: a verify row's
positions each have the grammar state after the drafts before them) sets disallowed tokens to
-inf, and the rows' logit_bias is added; every later step (penalties, temperature, filters,
verification) sees the masked and biased logits, so the drafts are verified against the same
constrained p that non-speculative sampling draws from. With ``num_logprobs`` set, the
log-probabilities of every emitted token and of the most likely tokens at its position come
back with the tokens (logprobs.py says which distribution), read in the same host read.

The emitted tokens therefore follow exactly the distribution of non-speculative sampling.
The heavy per-position work runs in three kernels, each a Triton kernel on CUDA with a torch twin
elsewhere (penalties.py, distribution.py, gumbel_max.py and their *_triton.py); the [R, K]-sized
bookkeeping between them is plain tensor code shared by both backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from flare.sampler import native_sampler as native
from flare.sampler.batch import SamplingBatch
from flare.sampler.gumbel_max import GumbelCandidates
from flare.sampler.logprobs import TokenLogprobs, log_normalizer, logprobs_at
from flare.sampler.logprobs import score_tokens as logprobs_score_tokens
from flare.sampler.penalties import PenaltyState
from flare.sampler.random_stream import Purpose, stream_bits, stream_key, uniform
from flare.sampler.status import DeviceStatus

Backend = Literal["torch", "triton"]


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
    vocab_shards: int = 1,
    backend: Backend | None = None,
    token_mask: torch.Tensor | None = None,
    num_logprobs: int | None = None,
    raw_logprobs: torch.Tensor | None = None,
) -> SampledRound:
    """Verify and sample every row of a round.

    logits: [N, V], the rows' positions in order (row r has num_drafts[r] + 1 of them).
    num_drafts: [R] integer. draft_tokens: [R, Kmax] int64, -1 past a row's drafts.
    draft_probs: [R, Kmax, V] draft distributions q, or None for deterministic drafters
    (q is one-hot on the proposed token).
    vocab_shards: S > 1 computes everything from per-shard statistics (vocabulary-parallel
    sampling); a sampled row with a filter then gets INVALID_SPECULATION.
    backend: "triton" (CUDA) or "torch"; by default triton on CUDA, torch elsewhere.
    token_mask: [N, ceil(V / 32)] int32 allowed-token bitmask per position, or None (no grammar).
    num_logprobs: None, or k >= 0: also report log p of each emitted token and the k most
    likely tokens at its position.
    raw_logprobs: [R] bool, or None: rows that report the raw model distribution (temperature
    1, nothing applied) instead of the one sampled from; costs one more statistics pass.
    """
    num_positions, vocab_size = logits.shape
    num_rows, max_drafts = draft_tokens.shape
    _check_shapes(logits, num_drafts, draft_tokens, draft_probs, batch, vocab_shards, token_mask)
    facts = batch.facts
    kernels = _kernels(backend or ("triton" if logits.is_cuda else "torch"))
    greedy_only = not facts.any_sampled and token_mask is None and num_logprobs is None and raw_logprobs is None
    if greedy_only and draft_probs is None and logits.device.type == "cpu" and native.available():
        # The same results in one call (greedy_tokens.c): at one row the few hundred operators
        # below cost more to dispatch than to compute.
        tokens, emitted, status = native.greedy_tokens(
            logits.float().contiguous(), num_drafts.to(torch.int64).contiguous(), draft_tokens.to(torch.int64).contiguous(), batch
        )
        return SampledRound(tokens=tokens, num_emitted=emitted, status=status)
    if greedy_only and num_positions == num_rows:
        return greedy_round(logits, batch, max_drafts, kernels)
    device = logits.device

    # A round of one position a row has no draft in any row, whatever draft_tokens' width: the
    # verification's statistics and draws are skipped (they would accept nothing).
    drafting = num_positions > num_rows
    layout = position_layout(num_drafts, num_rows, max_drafts, num_positions, device)
    num_drafts, row_start, row_of_position, index_in_row = (
        layout.num_drafts, layout.row_start, layout.row_of_position, layout.index_in_row
    )
    draft_index, is_draft = layout.draft_index, layout.is_draft

    # Drafts: -1 marks "no draft here" and an out-of-vocabulary id (status INVALID_DRAFT_TOKEN).
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab_size)
    invalid_draft_token = (is_draft & ~in_vocab).any(1)
    drafts = torch.where(is_draft & in_vocab, draft_tokens, -1)
    safe_drafts = drafts.clamp(min=0)

    kinds = row_kinds(batch)
    invalid_params, greedy, sampled, filtered_row = kinds.invalid_params, kinds.greedy, kinds.sampled, kinds.filtered
    filter_here = filtered_row & (vocab_shards == 1)
    top_k = torch.where(filter_here & (batch.top_k > 0), batch.top_k, 0)
    top_p = torch.where(filter_here, batch.top_p, 1.0)
    log_min_p = torch.where(filter_here, torch.log(batch.min_p), float("-inf"))
    divisor = torch.where(sampled, batch.temperature, 1.0)

    penalties = None
    if facts.any_penalized:
        assert batch.prompt_ids is not None and batch.output_ids is not None
        penalties = PenaltyState.from_ids(batch.prompt_ids, batch.output_ids, vocab_size)
    prepared = kernels.penalize_and_scale(
        logits,
        row_of_position,
        index_in_row,
        drafts,
        divisor,
        torch.where(invalid_params, 1.0, batch.repetition_penalty),
        torch.where(invalid_params, 0.0, batch.presence_penalty),
        torch.where(invalid_params, 0.0, batch.frequency_penalty),
        penalties,
        scale=facts.any_temperature_scaling,
        token_mask=token_mask,
        bias=batch.dense_bias(vocab_size),
    )
    scaled = prepared.scaled
    stats = kernels.distribution_statistics(
        scaled,
        row_of_position,
        top_k,
        top_p,
        log_min_p,
        vocab_shards,
        filtered=facts.any_filtered and vocab_shards == 1,
        max_top_k=facts.max_top_k,
        any_top_p=facts.any_top_p,
        # Gumbel-max needs no normalisation: Z only serves p(draft) and the residual.
        need_sumexp=(facts.any_sampled and drafting) or num_logprobs is not None,
        need_argmax=facts.any_greedy,
    )
    # Merge shard statistics (online softmax): m = max_s m_s, Z = sum_s Z_s exp(m_s - m).
    position_max = stats.max.amax(1)
    empty_position = ~torch.isfinite(position_max)
    threshold = stats.threshold

    nonfinite_row = _any_per_row(prepared.nonfinite, row_of_position, num_rows)
    empty_row = _any_per_row(empty_position, row_of_position, num_rows)

    draft_position = layout.draft_position
    accept = torch.zeros(num_rows, max_drafts, dtype=torch.bool, device=device)
    # Checked for every row, greedy ones too: a drafter that reports a probability outside
    # (0, 1] for its own proposal is broken, whatever the row's sampling.
    q_draft = None
    invalid_draft_prob = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if draft_probs is not None:
        q_draft = draft_probs.gather(2, safe_drafts.unsqueeze(2)).squeeze(2).float()
        invalid_draft_prob = (is_draft & ~((q_draft > 0) & (q_draft <= 1))).any(1)
    argmax = None
    if facts.any_greedy:
        assert stats.argmax is not None
        argmax = _merged_argmax(stats.max, stats.argmax)
        accept = torch.where(greedy.unsqueeze(1), drafts == argmax[draft_position], accept)
    sumexp = None
    if facts.any_sampled and drafting:
        assert stats.sumexp is not None
        sumexp = (stats.sumexp * torch.exp(stats.max - position_max.unsqueeze(1))).sum(1)
        draft_logit = scaled[draft_position, safe_drafts]
        accepted_sampled = sampled_acceptance(
            draft_logit, threshold[draft_position], position_max[draft_position], sumexp[draft_position], q_draft,
            batch, draft_index,
        )
        accept = torch.where(sampled.unsqueeze(1), accepted_sampled, accept)
    accept &= is_draft
    num_accepted = accept.to(torch.int64).cumprod(1).sum(1)
    sample_position = row_start + num_accepted

    token = torch.zeros(num_rows, dtype=torch.int64, device=device)
    if facts.any_sampled:
        token = _sample(
            kernels, scaled, batch, draft_probs, drafts, num_drafts, num_accepted, sample_position,
            position_max, sumexp, threshold, vocab_shards,
        )
    if argmax is not None:
        token = torch.where(greedy, argmax[sample_position], token)

    status = round_status(
        empty_row, nonfinite_row, invalid_draft_prob, invalid_draft_token, filtered_row & (vocab_shards > 1), invalid_params
    )
    ok = status == int(DeviceStatus.OK)
    tokens = emitted_tokens(drafts, num_accepted, token, ok)
    slot = torch.arange(max_drafts + 1, device=device).unsqueeze(0)
    logprobs = None
    if num_logprobs is not None:
        assert stats.sumexp is not None
        slot_position = (row_start.unsqueeze(1) + slot).clamp(max=num_positions - 1)
        logprobs = logprobs_at(
            kernels,
            scaled,
            threshold,
            log_normalizer(stats.max, stats.sumexp),
            slot_position,
            tokens,
            num_logprobs,
            vocab_shards,
        )
        if raw_logprobs is not None:
            raw = logprobs_score_tokens(kernels, logits, tokens, num_logprobs, vocab_shards, slot_position)
            logprobs = logprobs.where_rows(raw_logprobs.to(device), raw)
    return SampledRound(
        tokens=tokens,
        num_emitted=torch.where(ok, num_accepted + 1, 0).to(torch.int32),
        status=status.to(torch.int32),
        logprobs=logprobs,
    )


def greedy_round(logits: torch.Tensor, batch: SamplingBatch, max_drafts: int, kernels: ModuleType) -> SampledRound:
    """sample_round of a round whose rows are all greedy (or invalid) with one position each,
    without drafts, token mask or log-probabilities: the same results without the general path's
    few hundred operators, which at one row on a CPU cost a sixth of the round with the penalties
    a package's policy applies by default.

    Each row emits the argmax of its logits after its logit bias and penalties (the lowest index
    on ties, as the shards' merge gives). Its status is round_status's for such a row: no finite
    value after bias and penalties is EMPTY_DISTRIBUTION, a NaN or infinite raw logit
    NONFINITE_LOGITS (which wins), and invalid parameters win over both (their penalties are
    neutral, as in the general path). Like sample_round's, the tokens are [R, max_drafts + 1], -1
    after the first.

    The operators apply the general path's own penalize_and_scale (`kernels`, the backend's), so
    the values compared are the same floats. On the CPU, `native.greedy_tokens` computes the same
    (and verifies greedy rows' drafts) in one call.
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
    return SampledRound(
        tokens=tokens,
        num_emitted=ok.to(torch.int32),
        status=status.to(torch.int32),
    )


def score_tokens(
    logits: torch.Tensor,
    targets: torch.Tensor,
    num_top: int,
    vocab_shards: int = 1,
    backend: Backend | None = None,
) -> TokenLogprobs:
    """Log-probabilities of ``targets`` [P] under the raw model distribution at each position of
    ``logits`` [P, V], with the ``num_top`` most likely tokens (scoring a prompt: echo)."""
    kernels = _kernels(backend or ("triton" if logits.is_cuda else "torch"))
    return logprobs_score_tokens(kernels, logits, targets, num_top, vocab_shards)


def _sample(
    kernels: ModuleType,
    scaled: torch.Tensor,
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    num_accepted: torch.Tensor,
    sample_position: torch.Tensor,
    position_max: torch.Tensor,
    sumexp: torch.Tensor | None,
    threshold: torch.Tensor,
    vocab_shards: int,
) -> torch.Tensor:
    """The correction (after a rejection) or bonus token of every row, by Gumbel-max."""
    num_rows, max_drafts = drafts.shape
    rejected = num_accepted < num_drafts
    key = stream_key(batch.seed, batch.first_position + num_accepted, Purpose.SAMPLE)
    exclude = torch.full((num_rows,), -1, dtype=torch.int64, device=scaled.device)
    draft_q = None
    if max_drafts > 0:
        at_rejection = num_accepted.clamp(max=max_drafts - 1)
        if draft_probs is None:
            # One-hot q = e_x: max(p - q, 0) is p without x.
            rejected_token = drafts.gather(1, at_rejection.unsqueeze(1)).squeeze(1)
            exclude = torch.where(rejected, rejected_token, -1)
        else:
            draft_q = draft_probs[torch.arange(num_rows, device=scaled.device), at_rejection].float()
    candidates = kernels.gumbel_candidates(
        scaled,
        sample_position,
        key,
        position_max[sample_position],
        # Without drafts there is no residual, and Gumbel-max needs no Z.
        sumexp[sample_position] if sumexp is not None else torch.ones_like(position_max[sample_position]),
        threshold[sample_position],
        exclude,
        draft_q,
        vocab_shards,
    )
    return chosen_sample(candidates, rejected)


def chosen_sample(candidates: GumbelCandidates, rejected: torch.Tensor) -> torch.Tensor:
    """The sampled token of every row from the shards' candidates [R, S]: the best candidate
    of p, or, after a rejection against a general q, the best of the residual."""
    token = _best_candidate(candidates.index, candidates.value)
    if candidates.residual_index is None:
        return token
    assert candidates.residual_value is not None and candidates.residual_mass is not None
    residual_token = _best_candidate(candidates.residual_index, candidates.residual_value)
    # A residual of zero mass has probability zero in exact arithmetic (rejection then happens
    # with probability sum max(p - q, 0) = 0); after rounding, sample from p.
    use_residual = rejected & (candidates.residual_mass.sum(1) > 0)
    return torch.where(use_residual, residual_token, token)


@dataclass(frozen=True)
class PositionLayout:
    """Where each row's positions lie in the flat [N, V] logits."""

    num_drafts: torch.Tensor
    """[R] int64, clamped to [0, Kmax]."""
    row_start: torch.Tensor
    """[R]: the row's first position."""
    row_of_position: torch.Tensor
    """[N]."""
    index_in_row: torch.Tensor
    """[N]: 0 for a row's first position."""
    draft_index: torch.Tensor
    """[Kmax]: 0 .. Kmax - 1."""
    is_draft: torch.Tensor
    """[R, Kmax] bool: the row has a draft in this slot."""
    draft_position: torch.Tensor
    """[R, Kmax]: the position verifying each draft (clamped: entries past a row's drafts are
    masked by ``is_draft``)."""


def position_layout(
    num_drafts: torch.Tensor, num_rows: int, max_drafts: int, num_positions: int, device: torch.device
) -> PositionLayout:
    num_drafts = num_drafts.to(device=device, dtype=torch.int64).clamp(0, max_drafts)
    positions_per_row = num_drafts + 1
    row_start = torch.cumsum(positions_per_row, 0) - positions_per_row
    rows = torch.arange(num_rows, device=device)
    row_of_position = torch.repeat_interleave(rows, positions_per_row, output_size=num_positions)
    index_in_row = torch.arange(num_positions, device=device) - row_start[row_of_position]
    draft_index = torch.arange(max_drafts, device=device)
    return PositionLayout(
        num_drafts=num_drafts,
        row_start=row_start,
        row_of_position=row_of_position,
        index_in_row=index_in_row,
        draft_index=draft_index,
        is_draft=draft_index.unsqueeze(0) < num_drafts.unsqueeze(1),
        draft_position=(row_start.unsqueeze(1) + draft_index.unsqueeze(0)).clamp(max=num_positions - 1),
    )


@dataclass(frozen=True)
class RowKinds:
    invalid_params: torch.Tensor
    """[R] bool: out-of-range parameters (INVALID_SAMPLING_PARAMETERS; neutral values used)."""
    greedy: torch.Tensor
    sampled: torch.Tensor
    filtered: torch.Tensor
    """Sampled rows with top-k, top-p < 1 or min-p > 0."""


def row_kinds(batch: SamplingBatch) -> RowKinds:
    temperature = batch.temperature
    invalid_params = (
        ~(temperature >= 0)
        | torch.isinf(temperature)
        | ~((batch.top_p > 0) & (batch.top_p <= 1))
        | (batch.top_k < -1)
        | ~((batch.min_p >= 0) & (batch.min_p <= 1))
        | ~(batch.repetition_penalty > 0)
        | torch.isinf(batch.repetition_penalty)
        | ~torch.isfinite(batch.presence_penalty)
        | ~torch.isfinite(batch.frequency_penalty)
    )
    greedy = (temperature == 0) & ~invalid_params
    sampled = ~greedy & ~invalid_params
    filtered = sampled & ((batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0))
    return RowKinds(invalid_params=invalid_params, greedy=greedy, sampled=sampled, filtered=filtered)


def sampled_acceptance(
    draft_logit: torch.Tensor,
    draft_threshold: torch.Tensor,
    draft_max: torch.Tensor,
    draft_sumexp: torch.Tensor,
    q_draft: torch.Tensor | None,
    batch: SamplingBatch,
    draft_index: torch.Tensor,
) -> torch.Tensor:
    """[R, Kmax]: draft x_j accepted with probability min(1, p_j(x_j) / q_j(x_j)), drawn as
    ``u * q < p`` with u from the row's stream (seed, output position, ACCEPT); the draft's
    logit, kept-set threshold, merged max and sum of exponentials are given at its position."""
    p_draft = torch.where(draft_logit >= draft_threshold, torch.exp(draft_logit - draft_max), 0.0) / draft_sumexp
    output_position = batch.first_position.unsqueeze(1) + draft_index.unsqueeze(0)
    accept_key = stream_key(batch.seed.unsqueeze(1), output_position, Purpose.ACCEPT)
    u = uniform(stream_bits(accept_key, torch.zeros_like(accept_key)))
    if q_draft is None:
        return u < p_draft
    return u * q_draft < p_draft


def round_status(
    empty_row: torch.Tensor,
    nonfinite_row: torch.Tensor,
    invalid_draft_prob: torch.Tensor,
    invalid_draft_token: torch.Tensor,
    invalid_speculation: torch.Tensor,
    invalid_params: torch.Tensor,
) -> torch.Tensor:
    """[R] DeviceStatus codes; the later conditions win over the earlier ones."""
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


def _best_candidate(index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Merge per-shard Gumbel-max candidates: the largest value, the lowest shard on ties."""
    return index.gather(1, value.argmax(1, keepdim=True)).squeeze(1)


def _merged_argmax(shard_max: torch.Tensor, shard_argmax: torch.Tensor) -> torch.Tensor:
    """The global argmax from per-shard maxima (lowest index on ties: shards are in order)."""
    return shard_argmax.gather(1, shard_max.argmax(1, keepdim=True)).squeeze(1)


def _any_per_row(flags: torch.Tensor, row_of_position: torch.Tensor, num_rows: int) -> torch.Tensor:
    counts = torch.zeros(num_rows, dtype=torch.int32, device=flags.device)
    return counts.index_add_(0, row_of_position, flags.to(torch.int32)) > 0


def _check_shapes(
    logits: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    vocab_shards: int,
    token_mask: torch.Tensor | None,
) -> None:
    """Static shape checks (no tensor values are read)."""
    num_positions, vocab_size = logits.shape
    check_round_shapes("sample_round", num_positions, vocab_size, vocab_size, num_drafts, draft_tokens, draft_probs, batch, token_mask)
    if not 1 <= vocab_shards <= vocab_size:
        raise ValueError(f"sample_round: vocab_shards must be between 1 and the vocabulary size, got {vocab_shards}")


def check_round_shapes(
    caller: str,
    num_positions: int,
    vocab_size: int,
    draft_width: int,
    num_drafts: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    token_mask: torch.Tensor | None,
) -> None:
    """The shape checks a round's sampler inputs share, in one process or across ranks (whose
    draft_probs are a rank's `draft_width` columns): ValueError naming `caller` and the tensor."""
    num_rows, max_drafts = draft_tokens.shape
    if num_drafts.shape != (num_rows,) or batch.num_rows != num_rows:
        raise ValueError(
            f"{caller}: num_drafts {tuple(num_drafts.shape)}, draft_tokens {tuple(draft_tokens.shape)} "
            f"and the batch ({batch.num_rows} rows) must agree on the number of rows"
        )
    if num_positions < num_rows:
        raise ValueError(f"{caller}: logits has {num_positions} positions for {num_rows} rows (at least one each)")
    if token_mask is not None and token_mask.shape != (num_positions, -(-vocab_size // 32)):
        raise ValueError(
            f"{caller}: token_mask must be [N, ceil(V / 32)] = {(num_positions, -(-vocab_size // 32))}, "
            f"got {tuple(token_mask.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_rows, max_drafts, draft_width):
        raise ValueError(
            f"{caller}: draft_probs must be [R, Kmax, {'V' if draft_width == vocab_size else 'shard width'}] = "
            f"{(num_rows, max_drafts, draft_width)}, got {tuple(draft_probs.shape)}"
        )


def _kernels(backend: Backend) -> ModuleType:
    """The kernel functions of a backend; Triton is imported only when asked for."""
    if backend == "torch":
        from flare.sampler import torch_backend

        return torch_backend
    if backend == "triton":
        from flare.sampler.triton import backend as triton_backend

        return triton_backend
    raise ValueError(f"sample_round: backend must be 'torch' or 'triton', got {backend!r}")
