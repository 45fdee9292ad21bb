"""The route in one C call (`native.moe_route`, moe_route.c) is routing.py's route: the same
experts and weights to an ulp on random logits for every kind, the lower expert at a tie, a row's
route the same bits alone and in any batch, and bad arguments refused naming them. The MoE MLP
takes it wherever the kernels run, for both of its expert paths."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tests.engine.test_moe_layer import moe_config
from tests.engine.test_moe_native import EXPERTS as LAYER_EXPERTS
from tests.engine.test_moe_native import HIDDEN, K, WIDTH, T, blocks_moe_weights, stacked_experts
from flare.engine import native
from flare.engine.layers import moe
from flare.engine.layers.moe import moe_mlp, router_logits
from flare.engine.layers.routing import route
from flare.package.model_config import ModelConfig

pytestmark = pytest.mark.skipif(not native.available(), reason="the engine's C kernels were not built")

EXPERTS = 16
KINDS = {
    "softmax": {"norm_topk_prob": False},
    "softmax normalized": {"norm_topk_prob": True},
    "softmax_group_max": {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5},
    "sigmoid_group": {"n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    "sigmoid_group unnormalized": {"n_group": 4, "topk_group": 2},
    "topk_softmax": {"router_bias": True},
}


def config_of(kind: str, k: int = 4, hidden: int = EXPERTS) -> ModelConfig:
    options = dict(KINDS[kind])
    return ModelConfig(
        vocab_size=32, hidden_size=hidden, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
        eos_token_ids=(1,), num_experts=EXPERTS, moe_intermediate_size=8, moe_layers=(0,), num_experts_per_tok=k,
        routing=kind.split()[0], **options,  # type: ignore[arg-type]
    )


def c_route(x: torch.Tensor, router: torch.Tensor, config: ModelConfig, bias: torch.Tensor | None = None,
            correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    experts, weights, _ = native.moe_route(
        x, router, config.routing, config.num_experts_per_tok, router_bias=bias, correction_bias=correction,
        n_group=config.n_group, topk_group=config.topk_group, normalize=config.norm_topk_prob,
        scaling=config.routed_scaling_factor,
    )
    return experts, weights


def biases(kind: str, seed: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    bias = torch.randn(EXPERTS, generator=generator) if kind == "topk_softmax" else None
    correction = torch.randn(EXPERTS, generator=generator) / 4 if kind.startswith("sigmoid_group") else None
    return bias, correction


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("hidden", [64, 100])  # 100: not whole lanes of 8
def test_the_c_route_is_routing_pys_route_on_a_random_router(kind: str, hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    x = torch.randn(37, hidden, generator=generator)
    router = torch.randn(EXPERTS, hidden, generator=generator) / hidden**0.5
    bias, correction = biases(kind, hidden)
    config = config_of(kind, hidden=hidden)
    expected = route(router_logits(x, router, bias), config, correction)
    experts, weights = c_route(x, router, config, bias, correction)
    assert torch.equal(experts, expected.experts)
    torch.testing.assert_close(weights, expected.weights, atol=1e-7, rtol=1e-6)


def lower_index_route(scores: torch.Tensor, config: ModelConfig, kept_by: str) -> list[list[int]]:
    """Each row's experts where every tie goes to the lower index, groups first: an oracle in plain
    Python. `kept_by` is how a group scores: its best ('max') or its two best ('top2')."""
    size = EXPERTS // config.n_group
    routes = []
    for row in scores.tolist():
        group_scores = []
        for g in range(config.n_group):
            members = sorted(row[g * size : (g + 1) * size], reverse=True)
            group_scores.append(members[0] if kept_by == "max" else members[0] + members[1])
        groups = sorted(range(config.n_group), key=lambda g: (-group_scores[g], g))[: config.topk_group]
        eligible = [e for e in range(EXPERTS) if e // size in groups]
        routes.append(sorted(sorted(eligible, key=lambda e: (-row[e], e))[: config.num_experts_per_tok]))
    return routes


@pytest.mark.parametrize("kind", list(KINDS))
def test_ties_go_to_the_lower_expert_and_the_lower_group(kind: str) -> None:
    generator = torch.Generator().manual_seed(5)
    # Four values over 16 experts: ties at every top-k boundary and between groups. An identity
    # router makes the logits x itself.
    logits = torch.randint(0, 4, (64, EXPERTS), generator=generator).float()
    config = config_of(kind)
    correction = torch.randint(-2, 3, (EXPERTS,), generator=generator).float() * 0.25 if kind.startswith("sigmoid") else None
    experts, weights = c_route(logits, torch.eye(EXPERTS), config, correction=correction)
    if kind.startswith("sigmoid"):
        choice = torch.sigmoid(logits) + correction
        expected = lower_index_route(choice, config, "top2")
    else:
        expected = lower_index_route(logits, config, "max")
    assert experts.tolist() == expected
    assert torch.isfinite(weights).all() and (weights > 0).all()


def test_all_equal_logits_route_to_the_first_k_experts_with_equal_weights() -> None:
    config = config_of("softmax normalized")
    experts, weights = c_route(torch.zeros(3, EXPERTS), torch.eye(EXPERTS), config)
    assert experts.tolist() == [[0, 1, 2, 3]] * 3
    assert torch.equal(weights, torch.full((3, 4), 0.25))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_route_is_the_same_bits_alone_and_in_any_batch(kind: str, threads: int) -> None:
    generator = torch.Generator().manual_seed(9)
    hidden = 256
    x = torch.randn(70, hidden, generator=generator)  # 35 row tiles of 2
    router = torch.randn(EXPERTS, hidden, generator=generator)
    bias, correction = biases(kind, 9)
    config = config_of(kind, hidden=hidden)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = c_route(x, router, config, bias, correction)
        order = torch.randperm(70, generator=generator)
        shuffled = c_route(x[order].contiguous(), router, config, bias, correction)
        for row in (0, 3, 4, 69):
            alone = c_route(x[row : row + 1].contiguous(), router, config, bias, correction)
            assert torch.equal(alone[0][0], together[0][row]) and torch.equal(alone[1][0], together[1][row])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(shuffled[0], together[0][order]) and torch.equal(shuffled[1], together[1][order])


@pytest.mark.parametrize("kind", ["softmax normalized", "sigmoid_group"])
def test_the_portable_loop_and_avx2_give_the_same_bits(kind: str) -> None:
    generator = torch.Generator().manual_seed(13)
    hidden = 2048 + 12  # whole lanes of 16 and a tail
    x = torch.randn(7, hidden, generator=generator)
    router = torch.randn(EXPERTS, hidden, generator=generator) / 45
    _, correction = biases(kind, 13)
    config = config_of(kind, hidden=hidden)
    options = {
        "correction_bias": correction, "n_group": config.n_group, "topk_group": config.topk_group,
        "normalize": config.norm_topk_prob, "scaling": config.routed_scaling_factor,
    }
    portable = native.moe_route(x, router, config.routing, 4, isa=native.ISA_PORTABLE, **options)  # type: ignore[arg-type]
    vector = native.moe_route(x, router, config.routing, 4, isa=native.ISA_AVX512, **options)  # type: ignore[arg-type]
    assert torch.equal(portable[0], vector[0]) and torch.equal(portable[1], vector[1])


def test_a_shared_experts_gate_factor_is_the_sigmoid_of_its_logit_and_a_rows_own() -> None:
    """Qwen2-MoE's shared expert gate: sigmoid(gate . x) per row, from its logit summed as the
    router's (float64, rounded once), within an ulp of the float64 reference, the same bits alone
    and in a batch; the route itself unchanged by it."""
    generator = torch.Generator().manual_seed(31)
    x, router = torch.randn(9, 100, generator=generator), torch.randn(EXPERTS, 100, generator=generator) / 10
    gate = torch.randn(100, generator=generator) / 5
    experts, weights, scale = native.moe_route(x, router, "softmax", 4, shared_gate=gate)
    assert scale is not None and scale.shape == (9,)
    reference = torch.sigmoid((x.double() @ gate.double()).float().double()).float()
    torch.testing.assert_close(scale, reference, rtol=1.2e-7, atol=0)
    assert scale.max() - scale.min() > 0.3  # the logits spread: not a constant factor
    for row in (0, 8):
        alone = native.moe_route(x[row : row + 1].clone(), router, "softmax", 4, shared_gate=gate)[2]
        assert alone is not None and torch.equal(alone[0], scale[row])
    plain = native.moe_route(x, router, "softmax", 4)
    assert plain[2] is None and torch.equal(plain[0], experts) and torch.equal(plain[1], weights)


def test_a_row_of_nan_still_routes_to_experts_that_exist() -> None:
    x = torch.full((2, EXPERTS), float("nan"))
    for kind in KINDS:
        experts, _ = c_route(x, torch.eye(EXPERTS), config_of(kind))
        assert ((experts >= 0) & (experts < EXPERTS)).all(), kind


def test_bad_arguments_are_refused_naming_the_argument() -> None:
    x, router = torch.zeros(2, 8), torch.zeros(EXPERTS, 8)
    cases = {
        "x must be a CPU torch.float32": lambda: native.moe_route(x.double(), router, "softmax", 2),
        "router must be a contiguous [experts, 8]": lambda: native.moe_route(x, torch.zeros(EXPERTS, 9), "softmax", 2),
        "kind must be one of": lambda: native.moe_route(x, router, "argmax", 2),
        "k must be an integer in 1 .. 16": lambda: native.moe_route(x, router, "softmax", 17),
        "n_group must divide the 16 experts": lambda: native.moe_route(x, router, "sigmoid_group", 2, n_group=3),
        "topk_group lie in 1 .. n_group": lambda: native.moe_route(x, router, "sigmoid_group", 2, n_group=4, topk_group=5),
        "correction_bias must be a contiguous CPU float32 [16]": lambda: native.moe_route(
            x, router, "sigmoid_group", 2, correction_bias=torch.zeros(15)
        ),
        "scaling must be finite": lambda: native.moe_route(x, router, "softmax", 2, scaling=float("inf")),
        "shared_gate must be a contiguous CPU float32 [8]": lambda: native.moe_route(x, router, "softmax", 2, shared_gate=torch.zeros(7)),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=f"moe_route: .*{re.escape(message)}"):
            call()


def test_no_rows_route_to_empty_tensors() -> None:
    experts, weights, scale = native.moe_route(torch.zeros(0, 8), torch.zeros(EXPERTS, 8), "softmax", 2, shared_gate=torch.zeros(8))
    assert scale is not None and scale.shape == (0,)
    assert experts.shape == (0, 2) and weights.shape == (0, 2)


def test_the_moe_mlp_routes_in_c_for_both_expert_paths_and_in_torch_without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels the route is the C call whether the experts then run as one C call (blocks)
    or expert by expert; without them it is routing.py's."""
    gate_up, down = stacked_experts(T.Q8_0, seed=12)
    generator = torch.Generator().manual_seed(11)
    weights = blocks_moe_weights(gate_up, down, torch.randn(LAYER_EXPERTS, HIDDEN, generator=generator) / 16)
    config = moe_config(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts_per_tok=K)
    x = torch.randn(6, HIDDEN, generator=generator)
    calls: list[int] = []
    real = native.moe_route

    def counted(*args: object, **options: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return real(*args, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(moe.native, "moe_route", counted)
    one_call = moe_mlp(x, weights, config, kernels=True)
    looped = moe_mlp(x, dataclasses.replace(weights, gate_up_blocks=None, down_blocks=None), config, kernels=True)
    assert len(calls) == 2 and torch.equal(one_call, looped)
    torch_path = moe_mlp(x, weights, config, kernels=False)
    assert len(calls) == 2
    torch.testing.assert_close(torch_path, one_call, atol=1e-5, rtol=1e-4)
