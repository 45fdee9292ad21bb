"""Fixed rounds for the vocabulary-parallel tests: built the same, from seeds, in every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from flare.sampler.batch import SamplingBatch
from flare.policy.params import SamplingParams

VOCAB = 75
"""Not a multiple of 32, and shards of 38 and 37 tokens: rank 1's bitmask starts mid-word."""


@dataclass(frozen=True)
class SamplingCase:
    name: str
    logits: torch.Tensor
    num_drafts: torch.Tensor
    draft_tokens: torch.Tensor
    batch: SamplingBatch
    draft_probs: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    num_logprobs: int | None = None
    raw_logprobs: torch.Tensor | None = None
    kind: Literal["round", "score"] = "round"
    """round: sample_round; score: score_tokens (echo), targets = the first draft column."""


def _logits(positions: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(positions, VOCAB, generator=generator) * scale


def _batch(params: list[SamplingParams], prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch.from_rows(
        params,
        seeds=[1000 + 17 * r for r in range(rows)],
        positions=[3 * r for r in range(rows)],
        prompt_ids=prompts or [[]] * rows,
        output_ids=outputs or [[]] * rows,
        device="cpu",
    )


def _drafts_from_argmax(logits: torch.Tensor, num_drafts: list[int], wrong_at: dict[int, int]) -> torch.Tensor:
    """n-gram-like one-hot drafts: the argmax of the position before (accepted by a greedy
    row), except at ``wrong_at[row]`` where the draft is another token (rejected)."""
    k_max = max(num_drafts)
    drafts = torch.full((len(num_drafts), k_max), -1, dtype=torch.int64)
    start = 0
    for row, count in enumerate(num_drafts):
        for j in range(count):
            best = int(logits[start + j].argmax())
            drafts[row, j] = (best + 7) % VOCAB if wrong_at.get(row) == j else best
        start += count + 1
    return drafts


def _case(name: str, params: list[SamplingParams], num_drafts: list[int], seed: int, wrong_at: dict[int, int] | None = None, **extra) -> SamplingCase:
    positions = sum(num_drafts) + len(num_drafts)
    logits = extra.pop("logits", None)
    if logits is None:
        logits = _logits(positions, seed)
    drafts = extra.pop("draft_tokens", None)
    if drafts is None:
        drafts = _drafts_from_argmax(logits, num_drafts, wrong_at or {}) if max(num_drafts) else torch.full((len(num_drafts), 0), -1)
    batch = extra.pop("batch", None) or _batch(params)
    return SamplingCase(name, logits, torch.tensor(num_drafts), drafts, batch, **extra)


def sampling_cases() -> list[SamplingCase]:
    greedy = SamplingParams(temperature=0.0)
    warm = SamplingParams(temperature=0.8, seed=5)
    cases = [
        _case("greedy without drafts", [greedy] * 3, [0, 0, 0], seed=1),
        _case("greedy with n-gram drafts, one rejected", [greedy] * 3, [3, 2, 0], seed=2, wrong_at={1: 1}),
        _case("seeded sampling without drafts", [warm, SamplingParams(temperature=1.3)] * 2, [0, 0, 0, 0], seed=3),
        _case("seeded sampling with n-gram drafts", [warm] * 4, [4, 2, 3, 0], seed=4, wrong_at={0: 2, 2: 0}),
        _case("greedy and sampled rows together", [greedy, warm, greedy, warm], [2, 2, 1, 3], seed=5, wrong_at={3: 1}),
    ]
    penalized = [
        SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, frequency_penalty=1.1, logit_bias=((3, 5.0), (40, 8.0), (74, -100.0))),
    ]
    history = [[1, 2, 40, 41, 70], [38, 37, 5], [74, 74, 0]]
    cases.append(
        _case(
            "penalties and logit_bias across the shard boundary",
            penalized,
            [2, 1, 2],
            seed=6,
            batch=_batch(penalized, prompts=history, outputs=[[40, 40, 3], [37], [74, 12]]),
        )
    )
    mask_logits = _logits(7, 7)
    mask = _random_mask(7, seed=7)
    mask[0, :] = 0
    mask[0, 1] = 1 << 9  # position 0 allows token 41 alone: rank 0's shard is fully masked there
    cases.append(
        _case("grammar masks, one shard fully masked", [warm, greedy, warm], [2, 1, 1], seed=7, logits=mask_logits, token_mask=mask)
    )
    probs = _dirichlet((3, 3), seed=8)
    cases.append(_case("general draft distribution q (residual draws)", [warm] * 3, [3, 2, 3], seed=8, draft_probs=probs, wrong_at={0: 0, 1: 1, 2: 2}))
    cases.append(
        _case(
            "logprobs with raw rows, drafts and a mask",
            [warm, greedy, SamplingParams(temperature=1.0, presence_penalty=0.5)],
            [2, 2, 0],
            seed=9,
            token_mask=_random_mask(7, seed=9),
            num_logprobs=4,
            raw_logprobs=torch.tensor([False, True, True]),
            batch=_batch(
                [warm, greedy, SamplingParams(temperature=1.0, presence_penalty=0.5)],
                outputs=[[1], [2], [50, 50]],
            ),
        )
    )
    bad = _logits(5, 10)
    bad[2, 60] = float("nan")
    cases.append(
        _case(
            "non-finite logits and an out-of-vocabulary draft",
            [warm, greedy, warm],
            [1, 1, 0],
            seed=10,
            logits=bad,
            draft_tokens=torch.tensor([[VOCAB + 3], [4], [-1]]),
        )
    )
    filtered = [SamplingParams(temperature=0.7, top_k=5, seed=1), SamplingParams(temperature=0.7, top_p=0.8), warm]
    cases.append(_case("filtered rows get INVALID_SPECULATION", filtered, [2, 1, 1], seed=11))
    cases.append(
        _case("echo scoring", [greedy] * 6, [0] * 6, seed=12, draft_tokens=torch.tensor([[3], [44], [74], [0], [37], [38]]), num_logprobs=5, kind="score")
    )
    return cases


def _random_mask(positions: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    words = -(-VOCAB // 32)
    bits = torch.randint(0, 2, (positions, words * 32), generator=generator, dtype=torch.int64)
    bits[:, 0] = 1  # every position keeps a token
    weights = 1 << torch.arange(32, dtype=torch.int64)
    values = (bits.view(positions, words, 32) * weights).sum(2)
    return (values - ((values >> 31) << 32)).to(torch.int32)


def _dirichlet(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.Dirichlet(torch.full((VOCAB,), 0.3)).sample(shape)
