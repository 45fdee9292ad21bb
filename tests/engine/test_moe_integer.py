"""The one-call mixture-of-experts layer (`native_quantized.moe_layer`, moe_layer.c) on 8-bit activations
(`flare run --activations int8x2|int8`): each expert's products are quantized.py's integer ones,
so the call gives the bits of the loop over experts with the same integer kernels, the same bits
at every forced integer level, a row's bits its own in any batch, and `moe_mlp` takes the call."""

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
from tests.engine.test_moe_native import (
    EXPERTS, HIDDEN, K, WIDTH, blocks_moe_weights, one_call, random_routes, stacked_experts, torch_path,
)
from flare.engine import native, native_quantized
from flare.engine.layers.moe import moe_mlp, moe_routes, routed_experts
from flare.engine.layers.routing import Routes
from flare.engine.quantized import HALVES, QuantizedWeight

pytestmark = pytest.mark.skipif(not native.available(), reason="the one-call layer is a C kernel")

T = gguf.GGMLQuantizationType
# Q4_K_M's experts (Q4_K gate/up, Q6_K down), each K type, and 32-value types (integer_linear.c).
PAIRS = [(T.Q4_K, T.Q6_K), (T.Q5_K, T.Q4_K), (T.Q8_0, T.Q4_1), (T.Q4_0, T.Q5_K)]


def integer_experts(gate_up_type: T, down_type: T, activations: str, seed: int) -> tuple[QuantizedWeight, QuantizedWeight]:
    gate_up, down = stacked_experts(gate_up_type, seed=seed, down_type=down_type)
    return gate_up.with_activations(activations), down.with_activations(activations)


def integer_call(x: torch.Tensor, routes: Routes, gate_up: QuantizedWeight, down: QuantizedWeight, **options: object) -> torch.Tensor:
    """The call as moe_mlp makes it: each projection's halves from its weight."""
    return one_call(x, routes, gate_up, down, gate_up_halves=gate_up.halves, down_halves=down.halves, **options)


@pytest.mark.parametrize(("gate_up_type", "down_type"), PAIRS)
@pytest.mark.parametrize("activations", ["int8x2", "int8"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_the_integer_call_gives_the_bits_of_the_loop_over_experts_with_the_integer_kernels(
    gate_up_type: T, down_type: T, activations: str, tokens: int
) -> None:
    gate_up, down = integer_experts(gate_up_type, down_type, activations, seed=tokens)
    assert gate_up.halves == down.halves == HALVES[activations]
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    routes = random_routes(tokens, seed=tokens + 200)
    got = integer_call(x, routes, gate_up, down)
    assert torch.equal(got, torch_path(x, routes, gate_up, down))
    # Not the float32 activations' product, but close to it (int8x2 about 15 bits).
    exact = one_call(x, routes, gate_up, down)
    assert not torch.equal(got, exact)
    # (Random blocks: large activations into down, where one 8-bit block per 256 loses most.)
    tolerance = 2e-3 if activations == "int8x2" else 0.15
    assert (got - exact).abs().max() <= tolerance * exact.abs().max()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_integer_result_is_the_same_bits_alone_and_in_any_batch(threads: int) -> None:
    """Both schedules (threads over experts, or over each product's outputs when few experts are
    active) and any batch give a row the same bits."""
    gate_up, down = integer_experts(T.Q4_K, T.Q6_K, "int8x2", seed=7)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(8))
    routes = random_routes(40, seed=9)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = integer_call(x, routes, gate_up, down)
        for row in (0, 13, 39):
            route = Routes(routes.experts[row : row + 1], routes.weights[row : row + 1])
            alone = integer_call(x[row : row + 1].clone(), route, gate_up, down)
            assert torch.equal(alone[0], together[row])
        order = torch.randperm(40, generator=torch.Generator().manual_seed(10))
        shuffled = Routes(routes.experts[order].contiguous(), routes.weights[order].contiguous())
        assert torch.equal(integer_call(x[order].contiguous(), shuffled, gate_up, down), together[order])
    finally:
        torch.set_num_threads(before)


def test_the_moe_mlp_of_8_bit_experts_takes_the_one_call_and_keeps_the_loops_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up, down = integer_experts(T.Q4_K, T.Q6_K, "int8x2", seed=60)
    generator = torch.Generator().manual_seed(61)
    weights = blocks_moe_weights(gate_up, down, torch.randn(EXPERTS, HIDDEN, generator=generator) / 4)
    config = moe_config(
        hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts_per_tok=K, shared_expert_intermediate_size=0,
        shared_expert_gate=False,
    )
    x = torch.randn(5, HIDDEN, generator=generator)
    calls: list[dict[str, object]] = []
    real = native_quantized.moe_layer

    def counted(*args: object, **options: object) -> torch.Tensor:
        calls.append(options)
        return real(*args, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(native_quantized, "moe_layer", counted)
    got = moe_mlp(x, weights, config, kernels=True)
    assert [(c["gate_up_halves"], c["down_halves"]) for c in calls] == [(2, 2)]
    looped = dataclasses.replace(weights, gate_up_blocks=None, down_blocks=None)
    assert torch.equal(got, moe_mlp(x, looped, config, kernels=True))
    assert torch.equal(got, routed_experts(x, moe_routes(x, weights, config, kernels=True), weights, config, kernels=True))


FORCED_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.engine.test_moe_integer import forced_cases
from flare.engine import native, native_quantized
torch.save({{'isa': native_quantized.INTEGER_ISA, 'outputs': forced_cases()}}, {path!r})
"""


def forced_cases() -> list[torch.Tensor]:
    """Each pair's integer layer at 1 and 17 rows, both precisions, at the process's integer level
    (inputs from numpy, the same in every process)."""
    outputs = []
    for gate_up_type, down_type in PAIRS:
        for activations in ("int8x2", "int8"):
            gate_up, down = integer_experts(gate_up_type, down_type, activations, seed=30)
            for tokens in (1, 17):
                x = torch.from_numpy(np.random.default_rng(tokens).standard_normal((tokens, HIDDEN), dtype=np.float32))
                outputs.append(integer_call(x, random_routes(tokens, seed=31), gate_up, down))
    return outputs


@pytest.mark.parametrize("forced", ["avx_vnni", "avx2", "portable"])
def test_a_forced_integer_level_gives_the_same_bits(tmp_path: Path, forced: str) -> None:
    path = tmp_path / "outputs.pt"
    env = {**os.environ, "FLARE_INTEGER_ISA": forced}
    script = FORCED_SCRIPT.format(root=str(REPOSITORY), path=str(path))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300, cwd=REPOSITORY)
    forced_run = torch.load(path)
    assert forced_run["isa"] == min(native_quantized.INTEGER_ISA_NAMES[forced], native_quantized.INTEGER_ISA)
    for got, expected in zip(forced_run["outputs"], forced_cases(), strict=True):
        assert torch.equal(got, expected)


def test_bad_halves_and_a_type_without_integer_kernels_are_refused_naming_them() -> None:
    gate_up, down = stacked_experts(T.Q4_K, seed=40)
    x = torch.randn(2, HIDDEN)
    routes = random_routes(2, seed=41)
    with pytest.raises(ValueError, match="gate_up_halves"):
        one_call(x, routes, gate_up, down, gate_up_halves=3)
    with pytest.raises(ValueError, match="down_halves"):
        one_call(x, routes, gate_up, down, down_halves=-1)
    mxfp4_gate_up, mxfp4_down = stacked_experts(T.MXFP4, seed=42)
    with pytest.raises(ValueError, match="8-bit activations need a type with integer kernels"):
        one_call(x, routes, mxfp4_gate_up, mxfp4_down, gate_up_halves=2)
