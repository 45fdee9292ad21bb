"""What a round's inputs say before any logit is read: where each row's positions lie in the flat
logits, which kind of row each is, which drafts are usable, which filters apply, and whether the
shapes agree.

Row r owns ``num_drafts[r] + 1`` consecutive positions of the [N, V] logits: position j is the
target's prediction after the row's last accepted token and its first j drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.sampler.batch import SamplingBatch


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
    """row_start[r] = sum_{s < r} (num_drafts[s] + 1); position n belongs to the row whose
    [row_start, row_start + num_drafts + 1) holds it."""
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


def slot_positions(layout: PositionLayout, max_drafts: int, num_positions: int) -> torch.Tensor:
    """[R, Kmax + 1]: the position of each slot of a row's emitted tokens (clamped past the row's
    positions: those slots hold -1)."""
    slot = torch.arange(max_drafts + 1, device=layout.row_start.device).unsqueeze(0)
    return (layout.row_start.unsqueeze(1) + slot).clamp(max=num_positions - 1)


@dataclass(frozen=True)
class RowKinds:
    invalid_params: torch.Tensor
    """[R] bool: out-of-range parameters (INVALID_SAMPLING_PARAMETERS; neutral values used)."""
    greedy: torch.Tensor
    sampled: torch.Tensor
    filtered: torch.Tensor
    """Sampled rows with top-k, top-p < 1 or min-p > 0."""


def row_kinds(batch: SamplingBatch) -> RowKinds:
    """Each row is exactly one of invalid (a parameter out of its range), greedy (temperature 0)
    or sampled; a sampled row is also filtered when one of its filters is on."""
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


@dataclass(frozen=True)
class UsableDrafts:
    tokens: torch.Tensor
    """[R, Kmax] int64: the row's drafts, -1 past them and for an id outside the vocabulary."""
    invalid_token: torch.Tensor
    """[R] bool: some draft of the row is outside [0, V) (INVALID_DRAFT_TOKEN)."""


def usable_drafts(draft_tokens: torch.Tensor, layout: PositionLayout, vocab_size: int) -> UsableDrafts:
    """The drafts a round verifies: -1 marks "no draft here" and an out-of-vocabulary id."""
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab_size)
    return UsableDrafts(
        tokens=torch.where(layout.is_draft & in_vocab, draft_tokens, -1),
        invalid_token=(layout.is_draft & ~in_vocab).any(1),
    )


@dataclass(frozen=True)
class RowFilters:
    """The filters of every row, sanitised so that an unused one is off: top_k 0, top_p 1,
    log_min_p -inf; with the host facts that let the torch twin skip work."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    log_min_p: torch.Tensor
    filtered: bool
    """Some row is filtered and the filters apply at all."""
    max_top_k: int
    any_top_p: bool


def row_filters(batch: SamplingBatch, kinds: RowKinds, apply: bool) -> RowFilters:
    """The sampled rows' top-k, top-p and min-p (min-p as log min_p: it keeps logit >= m + log
    min_p); off everywhere unless ``apply`` (a merge of vocabulary shards does not filter)."""
    filter_here = kinds.filtered & apply
    return RowFilters(
        top_k=torch.where(filter_here & (batch.top_k > 0), batch.top_k, 0),
        top_p=torch.where(filter_here, batch.top_p, 1.0),
        log_min_p=torch.where(filter_here, torch.log(batch.min_p), float("-inf")),
        filtered=batch.facts.any_filtered and apply,
        max_top_k=batch.facts.max_top_k,
        any_top_p=batch.facts.any_top_p,
    )


def no_filters(num_rows: int, device: torch.device) -> RowFilters:
    """Filters off for ``num_rows`` rows: the raw model distribution."""
    return RowFilters(
        top_k=torch.zeros(num_rows, dtype=torch.int64, device=device),
        top_p=torch.ones(num_rows, device=device),
        log_min_p=torch.full((num_rows,), float("-inf"), device=device),
        filtered=False,
        max_top_k=0,
        any_top_p=False,
    )


def any_per_row(flags: torch.Tensor, row_of_position: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[R] bool: some position of the row has its flag set."""
    counts = torch.zeros(num_rows, dtype=torch.int32, device=flags.device)
    return counts.index_add_(0, row_of_position, flags.to(torch.int32)) > 0


def check_round_shapes(
    num_positions: int,
    vocab_size: int,
    draft_width: int,
    num_drafts: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    token_mask: torch.Tensor | None,
) -> None:
    """The static shape checks of a round's sampler inputs (no tensor values are read), in one
    process or across ranks (whose draft_probs are a rank's `draft_width` columns): ValueError
    naming the tensor."""
    num_rows, max_drafts = draft_tokens.shape
    if num_drafts.shape != (num_rows,) or batch.num_rows != num_rows:
        raise ValueError(
            f"sample_round: num_drafts {tuple(num_drafts.shape)}, draft_tokens {tuple(draft_tokens.shape)} "
            f"and the batch ({batch.num_rows} rows) must agree on the number of rows"
        )
    if num_positions < num_rows:
        raise ValueError(f"sample_round: logits has {num_positions} positions for {num_rows} rows (at least one each)")
    if token_mask is not None and token_mask.shape != (num_positions, -(-vocab_size // 32)):
        raise ValueError(
            f"sample_round: token_mask must be [N, ceil(V / 32)] = {(num_positions, -(-vocab_size // 32))}, "
            f"got {tuple(token_mask.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_rows, max_drafts, draft_width):
        raise ValueError(
            f"sample_round: draft_probs must be [R, Kmax, {'V' if draft_width == vocab_size else 'shard width'}] = "
            f"{(num_rows, max_drafts, draft_width)}, got {tuple(draft_probs.shape)}"
        )
