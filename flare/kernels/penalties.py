"""Penalties and temperature (torch twin of penalties_triton.py).

Definitions (the ones vLLM and the OpenAI API use):
- repetition penalty (CTRL, Keskar et al. 2019, as in Hugging Face and vLLM): every token that
  appears in the prompt or in the output so far has its logit divided by the penalty when
  positive and multiplied by it otherwise;
- frequency and presence penalties (OpenAI): over the output tokens only,
  ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``;
- then temperature: ``logit / temperature`` (greedy rows and rows with invalid parameters are
  scaled by 1; a greedy row's argmax ignores temperature and filters).

At draft position j of a verify row, the draft tokens before j count as output tokens: the target
distribution there is the one the request would see had it emitted them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PenaltyState:
    """Per-row penalty inputs on the device: which tokens the prompt holds, and output counts."""

    prompt_mask: torch.Tensor
    """[R, V] bool: the token occurs in the row's prompt."""
    output_counts: torch.Tensor
    """[R, V] int32: occurrences of the token in the row's output so far."""

    @classmethod
    def from_ids(cls, prompt_ids: torch.Tensor, output_ids: torch.Tensor, vocab_size: int) -> PenaltyState:
        """From padded id tensors ([R, L], pad -1; ids outside the vocabulary are ignored)."""
        return cls(
            prompt_mask=_counts(prompt_ids, vocab_size) > 0,
            output_counts=_counts(output_ids, vocab_size),
        )


def _counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    valid = (ids >= 0) & (ids < vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size, dtype=torch.int32, device=ids.device)
    return counts.scatter_add_(1, torch.where(valid, ids, 0), valid.to(torch.int32))


@dataclass(frozen=True)
class PreparedLogits:
    scaled: torch.Tensor
    """[N, V] float32: penalised logits divided by the row's temperature."""
    nonfinite: torch.Tensor
    """[N] bool: the raw logits of the position hold NaN or an infinity."""


def penalize_and_scale(
    logits: torch.Tensor,
    row_of_position: torch.Tensor,
    index_in_row: torch.Tensor,
    draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    penalties: PenaltyState | None,
    scale: bool,
) -> PreparedLogits:
    """Penalties (when ``penalties`` is given) and temperature (when ``scale``) for every position.

    ``draft_tokens`` [R, Kmax] holds valid ids or -1; ``temperature`` is the scaling divisor
    (1 for greedy rows). Per-row tensors are indexed through ``row_of_position``.
    """
    # NaN propagates through min and max, and an infinity is the max or the min. (amax and amin
    # are two vectorised passes; aminmax is one scalar pass, several times slower on CPU.)
    nonfinite = ~(torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1)))
    scaled = logits.float()
    if penalties is not None:
        counts = _counts_at_positions(penalties.output_counts, row_of_position, index_in_row, draft_tokens)
        seen = penalties.prompt_mask[row_of_position] | (counts > 0)
        penalty = repetition_penalty[row_of_position].unsqueeze(1)
        scaled = torch.where(seen, torch.where(scaled > 0, scaled / penalty, scaled * penalty), scaled)
        scaled = (
            scaled
            - frequency_penalty[row_of_position].unsqueeze(1) * counts.float()
            - presence_penalty[row_of_position].unsqueeze(1) * (counts > 0).float()
        )
    if scale:
        scaled = scaled / temperature[row_of_position].unsqueeze(1)
    return PreparedLogits(scaled=scaled, nonfinite=nonfinite)


def _counts_at_positions(
    output_counts: torch.Tensor,
    row_of_position: torch.Tensor,
    index_in_row: torch.Tensor,
    draft_tokens: torch.Tensor,
) -> torch.Tensor:
    """[N, V] output counts at each position: the row's counts plus its drafts before the position."""
    num_positions = row_of_position.shape[0]
    vocab_size = output_counts.shape[1]
    max_drafts = draft_tokens.shape[1]
    counts = output_counts[row_of_position]
    drafts = draft_tokens[row_of_position]
    before = (torch.arange(max_drafts, device=drafts.device) < index_in_row.unsqueeze(1)) & (drafts >= 0)
    flat_index = torch.arange(num_positions, device=drafts.device).unsqueeze(1) * vocab_size + drafts.clamp(min=0)
    counts.view(-1).scatter_add_(0, flat_index.view(-1), before.to(torch.int32).view(-1))
    return counts
