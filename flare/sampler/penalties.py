"""Token mask, logit bias, penalties and temperature (torch twin of penalties_triton.py).

In this order, per position:
- the token mask (a grammar's allowed tokens): a bitmask of int32 words per position, bit
  ``i % 32`` of word ``i // 32`` set when token i is allowed (the layout llguidance and xgrammar
  fill); a disallowed token's logit becomes -inf (by adding -inf; 0 to allowed ones), which
  every later step keeps at -inf;
- the logit bias (OpenAI's ``logit_bias``): a dense per-row [R, V] addend, 0 for unbiased tokens;
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
    ids: torch.Tensor
    """[R, Lp + Lo] int64: the prompt then the output ids, 0 where padded or out of vocabulary.
    Only these tokens (and the drafts) can be penalised, so the twin touches just them."""

    @classmethod
    def from_ids(cls, prompt_ids: torch.Tensor, output_ids: torch.Tensor, vocab_size: int) -> PenaltyState:
        """From padded id tensors ([R, L], pad -1; ids outside the vocabulary are ignored)."""
        ids = torch.cat([prompt_ids, output_ids], 1)
        return cls(
            prompt_mask=_counts(prompt_ids, vocab_size) > 0,
            output_counts=_counts(output_ids, vocab_size),
            ids=torch.where((ids >= 0) & (ids < vocab_size), ids, 0),
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
    token_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> PreparedLogits:
    """Mask (when ``token_mask`` [N, ceil(V / 32)] int32 is given), bias (``bias`` [R, V]
    float32), penalties (when ``penalties`` is given) and temperature (when ``scale``) for every
    position.

    ``draft_tokens`` [R, Kmax] holds valid ids or -1; ``temperature`` is the scaling divisor
    (1 for greedy rows). Per-row tensors are indexed through ``row_of_position``.
    ``nonfinite`` is decided on the raw logits: a mask's -inf is not a fault of the model.
    """
    # NaN propagates through min and max, and an infinity is the max or the min. (amax and amin
    # are two vectorised passes; aminmax is one scalar pass, several times slower on CPU.)
    nonfinite = ~(torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1)))
    scaled = logits.float()
    owned = scaled is not logits
    if token_mask is not None or bias is not None:
        if not owned:
            scaled, owned = scaled.clone(), True
        if token_mask is not None:
            scaled.add_(mask_addend(token_mask, scaled.shape[1]))
        if bias is not None:
            scaled.add_(bias.index_select(0, row_of_position))
    if penalties is not None:
        if not owned:
            scaled, owned = scaled.clone(), True
        _penalize_(scaled, row_of_position, index_in_row, draft_tokens, repetition_penalty,
                   presence_penalty, frequency_penalty, penalties)
    if scale:
        divisor = temperature[row_of_position].unsqueeze(1)
        scaled = scaled.div_(divisor) if owned else scaled / divisor
    return PreparedLogits(scaled=scaled, nonfinite=nonfinite)


# Byte b of the bitmask, as the addends of its 8 tokens: 0 where the bit is set, -inf where not
# (little-endian, as the int32 words' bytes lie in memory: byte 0 holds tokens 0-7 of the word).
_BYTE_ADDENDS = torch.where(
    ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)


def mask_addend(token_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] float32, 0 for allowed tokens and -inf for the rest, from the [N, ceil(V / 32)]
    int32 bitmask (bit i % 32 of word i // 32). One table lookup per byte, cheaper than shifting
    every token's word."""
    table = _BYTE_ADDENDS.to(token_mask.device)
    byte_index = token_mask.contiguous().view(torch.uint8).view(-1).to(torch.int64)
    return torch.embedding(table, byte_index).view(token_mask.shape[0], -1)[:, :vocab_size]


def _penalize_(
    scaled: torch.Tensor,
    row_of_position: torch.Tensor,
    index_in_row: torch.Tensor,
    draft_tokens: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    penalties: PenaltyState,
) -> None:
    """The penalties, in place, on the only tokens they can change: the row's prompt and output
    ids and its drafts. Each (position, id) pair gets the value of the dense formula for that
    token, so an id listed several times is written several times with the same value, and a
    listed token that is not penalised at this position (a later draft) is rewritten unchanged.
    """
    vocab_size = scaled.shape[1]
    drafts = draft_tokens[row_of_position]
    before = torch.arange(drafts.shape[1], device=drafts.device) < index_in_row.unsqueeze(1)
    ids = torch.cat([penalties.ids[row_of_position], drafts.clamp(min=0)], 1)
    flat = row_of_position.unsqueeze(1) * vocab_size + ids
    # Drafts before the position count as output (-1 never equals an id).
    draft_counts = ((drafts.unsqueeze(1) == ids.unsqueeze(2)) & before.unsqueeze(1)).sum(2, dtype=torch.int32)
    counts = penalties.output_counts.view(-1)[flat] + draft_counts
    seen = penalties.prompt_mask.view(-1)[flat] | (counts > 0)
    x = scaled.gather(1, ids)
    penalty = repetition_penalty[row_of_position].unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    x = (
        x
        - frequency_penalty[row_of_position].unsqueeze(1) * counts.float()
        - presence_penalty[row_of_position].unsqueeze(1) * (counts > 0).float()
    )
    scaled.scatter_(1, ids, x)
