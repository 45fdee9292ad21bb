"""Sampling parameters of one request, after the package policy has been applied."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Effective sampling parameters of one request.

    top_k of -1 or 0 disables top-k; top_p of 1 disables top-p; min_p of 0 disables min-p.
    temperature 0 means greedy. seed None means the scheduler picks one at admission, so
    every row on the device is seeded (the random stream is keyed by seed and position).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's logit_bias: (token id, addend) pairs, ids ascending; added to the logits after
    the token mask and before penalties and temperature."""

    @property
    def filtered(self) -> bool:
        """True when a filter truncates the distribution (what vocabulary-parallel sampling cannot do)."""
        return self.top_k not in (-1, 0) or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
