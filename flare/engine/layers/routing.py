"""Routing of a mixture-of-experts layer: a router's logits [T, E] to the k experts each token
runs and their weights, in float32, as pure functions of each row (a row's route never depends
on its batch-mates).

Each kind (`ModelConfig.routing`) is transformers' router of its family, computed as it is, so
that the chosen experts are the same even at ties (the same `torch.topk` on the same float32
values):

- softmax (Qwen2/3-MoE, Mixtral, DeepSeek-V2 greedy): p = softmax(logits); the k largest p;
  with `norm_topk_prob` each divided by their sum.
- softmax_group_max (DeepSeek-V2 group_limited_greedy): p = softmax(logits); the experts split
  into `n_group` groups scored by their largest p; the `topk_group` best groups kept (others'
  p -> 0); the k largest p among them.
- sigmoid_group (DeepSeek-V3): s = sigmoid(logits); the choice reads s + correction bias (the
  bias balances the load: it decides which experts run, never how much they weigh); groups
  scored by the sum of their two largest corrected scores, the `topk_group` best kept; the k
  largest corrected scores among them; their weights the uncorrected s, with `norm_topk_prob`
  divided by their sum + 1e-20.
- topk_softmax (gpt-oss): the k largest logits, their weights softmax over those k.

Every kind then multiplies the weights by `routed_scaling_factor` (1 but for DeepSeek).
The k experts of a row are returned in ascending expert order, the fixed order in which the
MoE layer sums their outputs.

Where the engine's C kernels run, the route is computed by `native.moe_route` (moe_route.c)
instead, in one call: the same experts (a tie goes to the lower expert there, where torch.topk's
choice among equal values is its implementation's) and the same weights to about an ulp. These
functions are its reference, and what runs without the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.package.model_config import ModelConfig


@dataclass(frozen=True)
class Routes:
    """Each token's k experts, ascending, int64 [T, k], and their weights, float32 [T, k]; where
    the C route ran with a shared expert's gate, its factor sigmoid(gate . x) float32 [T]."""

    experts: torch.Tensor
    weights: torch.Tensor
    shared_scale: torch.Tensor | None = None


def softmax_topk(logits: torch.Tensor, k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, k]: the k largest of softmax(logits), renormalized with `normalize`."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probabilities, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def softmax_group_max_topk(logits: torch.Tensor, k: int, *, n_group: int, topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, k]: DeepSeek-V2's group-limited greedy top-k (module docstring)."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    tokens, experts = probabilities.shape
    group_scores = probabilities.view(tokens, n_group, experts // n_group).max(dim=-1).values
    kept = _group_mask(group_scores, topk_group, experts // n_group)
    return torch.topk(probabilities.masked_fill(~kept, 0.0), k, dim=-1, sorted=False)


def sigmoid_group_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    k: int,
    *,
    n_group: int,
    topk_group: int,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, k]: DeepSeek-V3's routing (module docstring), before the scaling."""
    scores = torch.sigmoid(logits.float())
    choice = scores + correction_bias.float()
    tokens, experts = choice.shape
    group_scores = choice.view(tokens, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    kept = _group_mask(group_scores, topk_group, experts // n_group)
    chosen = torch.topk(choice.masked_fill(~kept, float("-inf")), k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, chosen


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, k]: the k largest logits, their weights softmax over those k (gpt-oss)."""
    top, experts = torch.topk(logits.float(), k, dim=-1)
    return torch.softmax(top, dim=-1), experts


def _group_mask(group_scores: torch.Tensor, topk_group: int, group_size: int) -> torch.Tensor:
    """[T, E] True for the experts of each row's `topk_group` best groups."""
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.repeat_interleave(group_size, dim=1)


def route(
    logits: torch.Tensor, config: ModelConfig, correction_bias: torch.Tensor | None = None
) -> Routes:
    """The routes of router logits [T, E] under `config.routing` (module docstring), the k experts
    of each row ascending."""
    k = config.num_experts_per_tok
    if config.routing == "softmax":
        weights, experts = softmax_topk(logits, k, normalize=config.norm_topk_prob)
    elif config.routing == "softmax_group_max":
        weights, experts = softmax_group_max_topk(logits, k, n_group=config.n_group, topk_group=config.topk_group)
    elif config.routing == "sigmoid_group":
        assert correction_bias is not None, "sigmoid_group routing needs the router's score correction bias"
        weights, experts = sigmoid_group_topk(
            logits, correction_bias, k, n_group=config.n_group, topk_group=config.topk_group, normalize=config.norm_topk_prob
        )
    else:
        assert config.routing == "topk_softmax", config.routing
        weights, experts = topk_softmax(logits, k)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    experts, order = experts.sort(dim=-1)
    return Routes(experts, weights.gather(1, order).float())
