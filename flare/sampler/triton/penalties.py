"""Token mask, logit bias, penalties and temperature in Triton: one program per position, a loop over the vocabulary.

Same arguments, results and floating-point operation order as penalties.penalize_and_scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flare.sampler.penalties import PenaltyState, PreparedLogits
from flare.sampler.triton.launch import FP_FUSION, block_size


@triton.jit
def penalize_and_scale_kernel(
    logits_ptr,
    scaled_ptr,
    nonfinite_ptr,
    row_of_position_ptr,
    index_in_row_ptr,
    drafts_ptr,
    divisor_ptr,
    repetition_ptr,
    presence_ptr,
    frequency_ptr,
    prompt_mask_ptr,
    output_counts_ptr,
    token_mask_ptr,
    bias_ptr,
    vocab_size,
    logits_stride,
    mask_words,
    MAX_DRAFTS: tl.constexpr,
    PENALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    MASK: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    position = tl.program_id(0).to(tl.int64)  # int64 offsets: N * V may pass 2**31
    row = tl.load(row_of_position_ptr + position)
    index_in_row = tl.load(index_in_row_ptr + position)
    divisor = tl.load(divisor_ptr + row)
    repetition = tl.load(repetition_ptr + row)
    presence = tl.load(presence_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    nonfinite = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        in_vocab = offsets < vocab_size
        x = tl.load(logits_ptr + position * logits_stride + offsets, mask=in_vocab, other=0.0).to(tl.float32)
        nonfinite = tl.maximum(nonfinite, ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32))
        if MASK:
            word = tl.load(token_mask_ptr + position * mask_words + (offsets >> 5), mask=in_vocab, other=0)
            allowed = ((word >> (offsets & 31).to(tl.int32)) & 1) != 0
            x = tl.where(allowed, x, float("-inf"))
        if BIAS:
            x = x + tl.load(bias_ptr + row * vocab_size + offsets, mask=in_vocab, other=0.0)
        if PENALIZE:
            count = tl.load(output_counts_ptr + row * vocab_size + offsets, mask=in_vocab, other=0)
            for d in tl.static_range(MAX_DRAFTS):
                # Drafts before this position count as output (-1 never matches an index).
                token = tl.load(drafts_ptr + row * MAX_DRAFTS + d)
                token = tl.where(d < index_in_row, token, -1)
                count += (offsets == token).to(tl.int32)
            in_prompt = tl.load(prompt_mask_ptr + row * vocab_size + offsets, mask=in_vocab, other=0)
            seen = (in_prompt != 0) | (count > 0)
            x = tl.where(seen, tl.where(x > 0, x / repetition, x * repetition), x)
            x = x - frequency * count.to(tl.float32) - presence * (count > 0).to(tl.float32)
        if SCALE:
            x = x / divisor
        tl.store(scaled_ptr + position * vocab_size + offsets, x, mask=in_vocab)
    tl.store(nonfinite_ptr + position, tl.max(nonfinite, 0))


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
    """Triton version of penalties.penalize_and_scale (same arguments and results)."""
    num_positions, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    scaled = torch.empty(num_positions, vocab_size, dtype=torch.float32, device=logits.device)
    nonfinite = torch.empty(num_positions, dtype=torch.int32, device=logits.device)
    drafts = draft_tokens.contiguous()
    if penalties is not None:
        prompt_mask = penalties.prompt_mask.contiguous().view(torch.uint8)
        output_counts = penalties.output_counts.contiguous()
    else:
        prompt_mask, output_counts = nonfinite, nonfinite  # never read
    mask_words = token_mask.shape[1] if token_mask is not None else 0
    has_bias = bias is not None
    token_mask = token_mask.to(torch.int32).contiguous() if token_mask is not None else nonfinite  # never read
    bias = bias.float().contiguous() if bias is not None else scaled  # never read
    penalize_and_scale_kernel[(num_positions,)](
        logits,
        scaled,
        nonfinite,
        row_of_position.contiguous(),
        index_in_row.contiguous(),
        drafts,
        temperature.float().contiguous(),
        repetition_penalty.float().contiguous(),
        presence_penalty.float().contiguous(),
        frequency_penalty.float().contiguous(),
        prompt_mask,
        output_counts,
        token_mask,
        bias,
        vocab_size,
        logits.stride(0),
        mask_words,
        MAX_DRAFTS=drafts.shape[1],
        PENALIZE=penalties is not None,
        SCALE=scale,
        MASK=mask_words > 0,
        BIAS=has_bias,
        BLOCK=block_size(vocab_size, logits.device),
        enable_fp_fusion=FP_FUSION,
    )
    return PreparedLogits(scaled=scaled, nonfinite=nonfinite.bool())
