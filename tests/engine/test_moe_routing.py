"""The MoE routing (flare/engine/layers/routing.py) is transformers' own router of each family:
on random logits, and on logits drawn from a few values so that ties are everywhere, it picks
the same experts with the same weights as Qwen3-MoE's, Qwen2-MoE's and Mixtral's softmax
routers, DeepSeek-V2's greedy and group-limited greedy ones, DeepSeek-V3's sigmoid router with
its score correction bias and group-limited top-k, and gpt-oss's top-k-then-softmax router.

Each router is transformers' module with an identity weight over a hidden size of E, so that the
logits it routes are exactly the ones given to flare."""

from __future__ import annotations

import pytest
import torch

from flare.engine.layers.routing import route
from flare.package.model_config import ModelConfig

transformers = pytest.importorskip("transformers")

EXPERTS = 16
TOKENS = 64


def flare_config(**moe: object) -> ModelConfig:
    return ModelConfig(
        vocab_size=32, hidden_size=EXPERTS, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
        eos_token_ids=(1,), num_experts=EXPERTS, moe_intermediate_size=8, moe_layers=(0,), **moe,  # type: ignore[arg-type]
    )


def logits_cases() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "random": torch.randn(TOKENS, EXPERTS, generator=generator) * 2,
        # Four values over 16 experts: ties at every top-k boundary and between groups.
        "ties": torch.randint(0, 4, (TOKENS, EXPERTS), generator=generator).float(),
        "all-equal": torch.zeros(TOKENS, EXPERTS),
    }


def identity_router(router: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        router.weight.copy_(torch.eye(EXPERTS))
    return router.eval()


def their_routes(router: torch.nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, weights) of transformers' router, both [T, k] in ascending expert order."""
    with torch.no_grad():
        output = router(logits)
    weights, experts = output[1], output[2]
    experts, order = experts.sort(dim=-1)
    return experts, weights.gather(1, order).float()


def assert_same_routes(config: ModelConfig, router: torch.nn.Module, logits: torch.Tensor, correction: torch.Tensor | None = None) -> None:
    experts, weights = their_routes(router, logits)
    ours = route(logits, config, correction)
    assert torch.equal(ours.experts, experts)
    torch.testing.assert_close(ours.weights, weights, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("case", list(logits_cases()))
@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_routing_is_qwen3_moe_and_qwen2_moe_routers(case: str, normalize: bool) -> None:
    logits = logits_cases()[case]
    for config_class, module in (
        (transformers.Qwen3MoeConfig, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter),
        (transformers.Qwen2MoeConfig, transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter),
    ):
        theirs = config_class(hidden_size=EXPERTS, num_experts=EXPERTS, num_experts_per_tok=4, norm_topk_prob=normalize)
        assert_same_routes(flare_config(num_experts_per_tok=4, norm_topk_prob=normalize), identity_router(module(theirs)), logits)


@pytest.mark.parametrize("case", list(logits_cases()))
def test_softmax_routing_renormalized_is_mixtral_router(case: str) -> None:
    theirs = transformers.MixtralConfig(hidden_size=EXPERTS, num_local_experts=EXPERTS, num_experts_per_tok=2)
    router = identity_router(transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(theirs))
    assert_same_routes(flare_config(num_experts_per_tok=2, norm_topk_prob=True), router, logits_cases()[case])


@pytest.mark.parametrize("case", list(logits_cases()))
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_is_its_router(case: str, method: str) -> None:
    theirs = transformers.DeepseekV2Config(
        hidden_size=EXPERTS, num_attention_heads=1, num_key_value_heads=1, n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method=method, routed_scaling_factor=1.5,
    )
    router = identity_router(transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(theirs))
    routing = "softmax" if method == "greedy" else "softmax_group_max"
    config = flare_config(num_experts_per_tok=3, routing=routing, n_group=4, topk_group=2, routed_scaling_factor=1.5)
    assert_same_routes(config, router, logits_cases()[case])


@pytest.mark.parametrize("case", list(logits_cases()))
@pytest.mark.parametrize("normalize", [True, False])
def test_deepseek_v3_routing_with_its_correction_bias_and_groups_is_its_router(case: str, normalize: bool) -> None:
    theirs = transformers.DeepseekV3Config(
        hidden_size=EXPERTS, num_attention_heads=1, num_key_value_heads=1, n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=normalize, routed_scaling_factor=2.5,
    )
    router = identity_router(transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(theirs))
    # Random, and in the tie case drawn from a few values too: the bias then ties choices as well.
    generator = torch.Generator().manual_seed(1)
    correction = torch.randint(-2, 3, (EXPERTS,), generator=generator).float() * 0.25 if case != "random" else torch.randn(EXPERTS, generator=generator)
    router.e_score_correction_bias.copy_(correction)
    config = flare_config(
        num_experts_per_tok=4, routing="sigmoid_group", n_group=4, topk_group=2, norm_topk_prob=normalize, routed_scaling_factor=2.5
    )
    assert_same_routes(config, router, logits_cases()[case], correction)


def test_the_correction_bias_chooses_experts_but_never_weighs_them() -> None:
    """A bias large enough to force expert 0 into every route: expert 0 is chosen, and its weight
    is its uncorrected sigmoid score (here unnormalized, unscaled)."""
    logits = logits_cases()["random"]
    correction = torch.zeros(EXPERTS)
    correction[0] = 100.0
    routes = route(logits, flare_config(num_experts_per_tok=2, routing="sigmoid_group", n_group=1, topk_group=1), correction)
    assert (routes.experts[:, 0] == 0).all()
    torch.testing.assert_close(routes.weights[:, 0], torch.sigmoid(logits[:, 0]))


@pytest.mark.parametrize("case", list(logits_cases()))
def test_topk_then_softmax_routing_is_gpt_oss_router(case: str) -> None:
    theirs = transformers.GptOssConfig(hidden_size=EXPERTS, num_attention_heads=1, num_key_value_heads=1, num_local_experts=EXPERTS, num_experts_per_tok=4)
    router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(theirs)
    bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        router.bias.copy_(bias)  # transformers starts it at 0, which would hide where it is added
    hidden = logits_cases()[case]
    experts, weights = their_routes(identity_router(router), hidden)
    # flare's router adds its bias to the logits (`moe.moe_routes`) before the top-k.
    ours = route(hidden + bias, flare_config(num_experts_per_tok=4, routing="topk_softmax", router_bias=True))
    assert torch.equal(ours.experts, experts)
    torch.testing.assert_close(ours.weights, weights, atol=1e-7, rtol=1e-6)


def test_a_route_never_depends_on_the_rows_beside_it() -> None:
    logits = logits_cases()["ties"]
    config = flare_config(num_experts_per_tok=4, routing="sigmoid_group", n_group=4, topk_group=2, norm_topk_prob=True)
    correction = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(2))
    together = route(logits, config, correction)
    for row in (0, 17, TOKENS - 1):
        alone = route(logits[row : row + 1], config, correction)
        assert torch.equal(alone.experts[0], together.experts[row]) and torch.equal(alone.weights[0], together.weights[row])
