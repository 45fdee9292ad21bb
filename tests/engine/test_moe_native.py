"""A round's mixture-of-experts MLP as one C call (`native_quantized.moe_layer`, moe_layer.c): the torch
path's bits with the kernels (expert by expert through `quantized_linear` and `gated_rows`), a
row's bits its own in any batch and at every ISA, and bad arguments refused by name."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests import REPOSITORY
from tests.engine.test_moe_layer import moe_config
from tests.engine.test_quantized_linear import weight_of
from flare.engine import native, native_quantized
from flare.engine.layers.moe import MoEWeights, expert_weights, moe_mlp, routed_experts
from flare.engine.layers.routing import Routes
from flare.engine.precision import WeightFormat
from flare.engine.quantized import QuantizedWeight

pytestmark = pytest.mark.skipif(not native.available(), reason="the one-call layer is a C kernel")

T = gguf.GGMLQuantizationType
EXPERTS, K = 8, 3
# Widths of whole blocks of every type tested (a K type's block is 256 values).
HIDDEN, WIDTH = 256, 256


def stacked_experts(ggml_type: T, seed: int, down_type: T | None = None) -> tuple[QuantizedWeight, QuantizedWeight]:
    """Stacked gate/up [E * 2 I, hidden] blocks of `ggml_type` and down [E * hidden, I] blocks of
    `down_type` (default the same)."""
    return (
        weight_of(ggml_type, EXPERTS * 2 * WIDTH, HIDDEN, seed=seed),
        weight_of(down_type or ggml_type, EXPERTS * HIDDEN, WIDTH, seed=seed + 1),
    )


def blocks_moe_weights(gate_up: QuantizedWeight, down: QuantizedWeight, router: torch.Tensor, **shared: object) -> MoEWeights:
    """A MoE MLP over stacked expert blocks: each expert a view of them (the loop's weights) and the
    stacks themselves (the one call's), with `router` and any shared expert."""
    float32 = WeightFormat("float32")
    return MoEWeights(
        router=router, gate_up=expert_weights(gate_up, EXPERTS, float32), down=expert_weights(down, EXPERTS, float32),
        gate_up_blocks=gate_up, down_blocks=down, **shared,  # type: ignore[arg-type]
    )


def random_routes(tokens: int, seed: int) -> Routes:
    """Each row's K distinct experts ascending and random positive weights."""
    generator = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(EXPERTS, generator=generator)[:K].sort().values for _ in range(tokens)])
    return Routes(experts=experts.contiguous(), weights=torch.rand(tokens, K, generator=generator) + 0.05)


def torch_path(x: torch.Tensor, routes: Routes, gate_up: QuantizedWeight, down: QuantizedWeight) -> torch.Tensor:
    """moe.py's expert-by-expert path with the kernels, on the same route (no shared expert)."""
    float32 = WeightFormat("float32")
    weights = MoEWeights(
        router=torch.zeros(EXPERTS, HIDDEN),
        gate_up=expert_weights(gate_up, EXPERTS, float32),
        down=expert_weights(down, EXPERTS, float32),
    )
    config = moe_config(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts_per_tok=K)
    return routed_experts(x, routes, weights, config, kernels=True)


def one_call(x: torch.Tensor, routes: Routes, gate_up: QuantizedWeight, down: QuantizedWeight, **options: object) -> torch.Tensor:
    return native_quantized.moe_layer(
        x, routes.experts, routes.weights, gate_up.data, gate_up.ggml_type, down.data, down.ggml_type, EXPERTS, **options
    )


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q4_1])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_the_one_call_layer_gives_the_torch_paths_bits_for_random_routes(ggml_type: T, tokens: int) -> None:
    gate_up, down = stacked_experts(ggml_type, seed=tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    routes = random_routes(tokens, seed=tokens + 100)
    got = one_call(x, routes, gate_up, down)
    assert torch.equal(got, torch_path(x, routes, gate_up, down))
    assert got.abs().sum() > 0


def test_a_q4_k_m_layers_q4_k_gate_up_and_q6_k_down_give_the_torch_paths_bits() -> None:
    """llama.cpp's Q4_K_M keeps some layers' expert down projections in Q6_K."""
    gate_up, down = stacked_experts(T.Q4_K, seed=50, down_type=T.Q6_K)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(51))
    routes = random_routes(12, seed=52)
    assert torch.equal(one_call(x, routes, gate_up, down), torch_path(x, routes, gate_up, down))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_a_rows_result_is_the_same_bits_alone_and_in_any_batch(activation: str) -> None:
    gate_up, down = stacked_experts(T.Q4_K, seed=7)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(8))
    routes = random_routes(40, seed=9)
    together = one_call(x, routes, gate_up, down, activation=activation)
    for row in (0, 13, 39):
        route = Routes(routes.experts[row : row + 1], routes.weights[row : row + 1])
        alone = one_call(x[row : row + 1].clone(), route, gate_up, down, activation=activation)
        assert torch.equal(alone[0], together[row])
    order = torch.randperm(40, generator=torch.Generator().manual_seed(10))
    shuffled = Routes(routes.experts[order].contiguous(), routes.weights[order].contiguous())
    assert torch.equal(one_call(x[order].contiguous(), shuffled, gate_up, down, activation=activation), together[order])


def test_the_moe_mlp_runs_the_one_call_layer_on_blocks_and_keeps_the_torch_paths_bits() -> None:
    """Through `moe_mlp` with routing, the shared expert and its gate: the stacked blocks kept in
    MoEWeights take the one call, and without them the expert-by-expert loop gives the same bits."""
    gate_up, down = stacked_experts(T.Q8_0, seed=20)
    generator = torch.Generator().manual_seed(21)
    shared_gate_up, shared_down = weight_of(T.Q8_0, 2 * WIDTH, HIDDEN, seed=22), weight_of(T.Q8_0, HIDDEN, WIDTH, seed=23)
    weights = blocks_moe_weights(
        gate_up, down, torch.randn(EXPERTS, HIDDEN, generator=generator) / 4, shared_gate_up=shared_gate_up,
        shared_down=shared_down, shared_gate=torch.randn(1, HIDDEN, generator=generator) / 16,
    )
    config = moe_config(
        hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts_per_tok=K, shared_expert_intermediate_size=WIDTH
    )
    x = torch.randn(9, HIDDEN, generator=generator)
    looped = dataclasses.replace(weights, gate_up_blocks=None, down_blocks=None)
    assert torch.equal(moe_mlp(x, weights, config, kernels=True), moe_mlp(x, looped, config, kernels=True))


FORCED_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.engine.test_moe_native import forced_cases
from flare.engine import native, native_quantized
torch.save({{'isa': native_quantized.QUANTIZED_ISA, 'outputs': forced_cases()}}, {path!r})
"""


def forced_cases() -> list[torch.Tensor]:
    """Each tested type's layer at 1 and 17 rows with the process's default ISA (inputs from numpy:
    torch's randn draws other values under another ATEN_CPU_CAPABILITY)."""
    outputs = []
    for ggml_type in (T.Q8_0, T.Q4_K, T.Q4_1):
        gate_up, down = stacked_experts(ggml_type, seed=30)
        for tokens in (1, 17):
            x = torch.from_numpy(np.random.default_rng(tokens).standard_normal((tokens, HIDDEN), dtype=np.float32))
            outputs.append(one_call(x, random_routes(tokens, seed=31), gate_up, down))
    return outputs


@pytest.mark.parametrize(("capability", "isa"), [("avx2", native.ISA_AVX2), ("default", native.ISA_PORTABLE)])
def test_forced_avx2_and_forced_portable_dispatch_give_the_same_bits(tmp_path: Path, capability: str, isa: int) -> None:
    path = tmp_path / "outputs.pt"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    script = FORCED_SCRIPT.format(root=REPOSITORY, path=str(path))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    forced = torch.load(path)
    assert forced["isa"] == isa
    for got, expected in zip(forced["outputs"], forced_cases(), strict=True):
        assert torch.equal(got, expected)


def gpt_oss_options(seed: int, limit: float = 7.0) -> dict[str, object]:
    """gpt-oss's expert options with random (non-zero) biases: transformers starts them at zero,
    which would hide a kernel that ignores them."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "activation": "clamped_swiglu", "swiglu": (1.702, limit),
        "gate_up_bias": torch.randn(EXPERTS, 2 * WIDTH, generator=generator),
        "down_bias": torch.randn(EXPERTS, HIDDEN, generator=generator),
    }


@pytest.mark.parametrize("ggml_type", [T.MXFP4, T.Q8_0])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_gpt_oss_experts_biases_and_clamped_swiglu_give_the_torch_paths_bits(ggml_type: T, tokens: int) -> None:
    """gpt-oss's experts (biases on gate/up and down, the clamped SwiGLU) in the one call: the bits
    of moe.py's expert-by-expert `_expert` with the kernels; the biases and the clamp both change
    the result, so neither can be ignored unseen."""
    gate_up, down = stacked_experts(ggml_type, seed=60 + tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(61)) * 4
    routes = random_routes(tokens, seed=62)
    options = gpt_oss_options(seed=63)
    weights = dataclasses.replace(
        blocks_moe_weights(gate_up, down, torch.zeros(EXPERTS, HIDDEN)),
        gate_up_bias=options["gate_up_bias"], down_bias=options["down_bias"],
    )
    config = moe_config(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts_per_tok=K, hidden_activation="clamped_swiglu",
                        swiglu_limit=7.0, shared_expert_intermediate_size=0, shared_expert_gate=False)
    got = one_call(x, routes, gate_up, down, **options)
    assert torch.equal(got, routed_experts(x, routes, weights, config, kernels=True))
    assert not torch.equal(got, one_call(x, routes, gate_up, down, **{**options, "swiglu": (1.702, 1e6)}))
    assert not torch.equal(got, one_call(x, routes, gate_up, down, **{**options, "down_bias": None}))
    assert not torch.equal(got, one_call(x, routes, gate_up, down, **{**options, "gate_up_bias": None}))


def test_bad_arguments_are_refused_naming_the_argument() -> None:
    gate_up, down = stacked_experts(T.Q8_0, seed=40)
    x = torch.randn(2, HIDDEN)
    routes = random_routes(2, seed=41)
    outside = routes.experts.clone()
    outside[1, 2] = EXPERTS
    cases = {
        "x": lambda: one_call(x.double(), routes, gate_up, down),
        "expert_ids": lambda: one_call(x, Routes(outside, routes.weights), gate_up, down),
        "expert_weights": lambda: one_call(x, Routes(routes.experts, routes.weights[:, :2].contiguous()), gate_up, down),
        "down": lambda: native_quantized.moe_layer(
            x, routes.experts, routes.weights, gate_up.data, gate_up.ggml_type, down.data[: EXPERTS * HIDDEN // 2],
            down.ggml_type, EXPERTS,
        ),
        "gate_up": lambda: native_quantized.moe_layer(
            x, routes.experts, routes.weights, gate_up.data, int(T.Q4_K), down.data, down.ggml_type, EXPERTS
        ),
        "activation": lambda: one_call(x, routes, gate_up, down, activation="relu"),
        "alpha, limit": lambda: one_call(x, routes, gate_up, down, activation="clamped_swiglu"),
        "gate_up_bias": lambda: one_call(x, routes, gate_up, down, gate_up_bias=torch.zeros(EXPERTS, HIDDEN)),
        "down_bias": lambda: one_call(x, routes, gate_up, down, down_bias=torch.zeros(EXPERTS, HIDDEN, dtype=torch.float64)),
        "num_experts": lambda: native_quantized.moe_layer(
            x, routes.experts, routes.weights, gate_up.data, gate_up.ggml_type, down.data, down.ggml_type, 0
        ),
    }
    for name, call in cases.items():
        with pytest.raises(ValueError, match=name):
            call()
