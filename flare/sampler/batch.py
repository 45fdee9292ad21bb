"""SamplingBatch: the per-row sampling parameters of one round, as device tensors.

Built once per round from the rows' effective SamplingParams with one host->device tensor per
kind of field (not one per row). Alongside the tensors it carries host-side facts known from the
parameters (any row penalized, any row filtered, ...) so the kernels skip whole stages without
reading tensor values back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flare.policy.params import SamplingParams


@dataclass(frozen=True)
class BatchFacts:
    """Static facts about a batch, taken from the host-side parameters."""

    any_greedy: bool
    any_sampled: bool
    any_penalized: bool
    any_filtered: bool
    """Some sampled row (temperature > 0) has top-k, top-p < 1 or min-p > 0."""
    max_top_k: int
    """The largest enabled top_k of a sampled row (0 when none is enabled)."""
    any_top_p: bool
    any_temperature_scaling: bool
    """Some row has a temperature other than 0 and 1."""
    any_biased: bool = False
    """Some row has a logit_bias."""


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling state of a round; every tensor has R rows, on one device.

    ``first_position`` is the index, in the request's output, of the first token sampled this
    round: the random stream of a row's j-th token this round is keyed by
    (seed, first_position + j). ``prompt_ids`` and ``output_ids`` (padded with -1) carry the
    penalty state; they are None when no row is penalized. ``bias_ids``/``bias_values``
    [R, B] (ids padded with -1) carry the rows' logit_bias; None when no row has one.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seed: torch.Tensor
    first_position: torch.Tensor
    prompt_ids: torch.Tensor | None
    output_ids: torch.Tensor | None
    facts: BatchFacts
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_rows(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> SamplingBatch:
        """The batch of ``params`` (one per row) with each row's effective seed and the output
        position of its first token this round; ``prompt_ids``/``output_ids`` are read only
        when some row is penalized."""
        rows = len(params)
        if not (len(seeds) == len(positions) == len(prompt_ids) == len(output_ids) == rows):
            raise ValueError(
                f"SamplingBatch.from_rows: params, seeds, positions, prompt_ids and output_ids must "
                f"have one entry per row ({rows} params, {len(seeds)} seeds, {len(positions)} "
                f"positions, {len(prompt_ids)} prompts, {len(output_ids)} outputs)"
            )
        floats = torch.tensor(
            [
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            ],
            dtype=torch.float32,
        ).to(device)
        # Seeds are taken modulo 2**64 and stored as int64 (two's complement).
        wrapped_seeds = [((s + (1 << 63)) % (1 << 64)) - (1 << 63) for s in seeds]
        ints = torch.tensor(
            [[p.top_k for p in params], wrapped_seeds, list(positions)], dtype=torch.int64
        ).to(device)
        penalized = any(p.penalized for p in params)
        sampled = [p for p in params if p.temperature != 0.0]
        top_ks = [p.top_k for p in sampled if p.top_k > 0]
        facts = BatchFacts(
            any_greedy=len(sampled) < rows,
            any_sampled=bool(sampled),
            any_penalized=penalized,
            any_filtered=any(p.filtered for p in sampled),
            max_top_k=max(top_ks, default=0),
            any_top_p=any(p.top_p < 1.0 for p in sampled),
            any_temperature_scaling=any(p.temperature not in (0.0, 1.0) for p in params),
            any_biased=any(p.logit_bias for p in params),
        )
        bias_ids = bias_values = None
        if facts.any_biased:
            width = max(len(p.logit_bias) for p in params)
            bias_ids = torch.tensor(
                [[t for t, _ in p.logit_bias] + [-1] * (width - len(p.logit_bias)) for p in params], dtype=torch.int64
            ).to(device)
            bias_values = torch.tensor(
                [[b for _, b in p.logit_bias] + [0.0] * (width - len(p.logit_bias)) for p in params],
                dtype=torch.float32,
            ).to(device)
        return cls(
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            top_k=ints[0],
            seed=ints[1],
            first_position=ints[2],
            prompt_ids=_padded(prompt_ids, device) if penalized else None,
            output_ids=_padded(output_ids, device) if penalized else None,
            facts=facts,
            bias_ids=bias_ids,
            bias_values=bias_values,
        )

    def dense_bias(self, vocab_size: int) -> torch.Tensor | None:
        """[R, V] float32: each row's logit_bias as an addend (ids outside the vocabulary are
        ignored: the API refuses them, and a kernel must not write past a row)."""
        if self.bias_ids is None or self.bias_values is None:
            return None
        valid = (self.bias_ids >= 0) & (self.bias_ids < vocab_size)
        bias = torch.zeros(self.num_rows, vocab_size, dtype=torch.float32, device=self.bias_ids.device)
        return bias.scatter_add_(1, torch.where(valid, self.bias_ids, 0), torch.where(valid, self.bias_values, 0.0))


def _padded(rows: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """[R, max(len)] int64, padded with -1 (at least one column, so scatters stay shaped)."""
    width = max((len(r) for r in rows), default=0) or 1
    flat = [list(r) + [-1] * (width - len(r)) for r in rows]
    return torch.tensor(flat, dtype=torch.int64).view(len(rows), width).to(device)
