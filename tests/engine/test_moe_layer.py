"""The mixture-of-experts MLP (flare/engine/layers/moe.py): a row's output is the same bits alone
and in any batch, and its experts are views of the stacked tensor, never copies of its blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from flare.engine import native
from flare.engine.layers.moe import MoEWeights, expert_weights, moe_mlp
from flare.engine.precision import WeightFormat
from flare.engine.quantized import QuantizedWeight
from flare.package.model_config import ModelConfig

HIDDEN, WIDTH, EXPERTS = 64, 32, 8
FLOAT32 = WeightFormat("float32")


def moe_config(**fields: object) -> ModelConfig:
    values: dict[str, object] = dict(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
        eos_token_ids=(1,), num_experts=EXPERTS, num_experts_per_tok=3, moe_intermediate_size=WIDTH, moe_layers=(0,),
        norm_topk_prob=True, shared_expert_intermediate_size=64, shared_expert_gate=True,
    )
    values.update(fields)
    return ModelConfig(**values)  # type: ignore[arg-type]


def q8_0_experts(values: torch.Tensor) -> QuantizedWeight:
    """Stacked experts [E, out, in] as Q8_0 blocks of their E * out rows."""
    rows = values.reshape(-1, values.shape[-1]).numpy()
    blocks = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)))
    return QuantizedWeight.from_blocks(gguf.GGMLQuantizationType.Q8_0, blocks, rows.shape[0], rows.shape[1])


def random_weights(kind: str = "float32", seed: int = 0) -> MoEWeights:
    """Random experts, shared expert and gate; every linear layer in `kind`: float32, float16
    (the engine's kernel) or q8_0 blocks (the stacked experts' rows)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) / shape[-1] ** 0.5

    def stack(*shape: int) -> tuple:
        values = randn(*shape)
        if kind == "q8_0":
            return expert_weights(q8_0_experts(values), shape[0], FLOAT32)
        return expert_weights(values, shape[0], WeightFormat(kind))

    def single(*shape: int) -> object:
        return stack(1, *shape)[0]

    return MoEWeights(
        router=randn(EXPERTS, HIDDEN) * 4,
        gate_up=stack(EXPERTS, 2 * WIDTH, HIDDEN),
        down=stack(EXPERTS, HIDDEN, WIDTH),
        shared_gate_up=single(128, HIDDEN),
        shared_down=single(HIDDEN, 64),
        shared_gate=randn(1, HIDDEN),
    )


@pytest.mark.skipif(not native.available(), reason="row-independent products are the engine's C kernels")
@pytest.mark.parametrize("kind", ["float16", "q8_0"])
def test_a_rows_output_is_the_same_bits_alone_and_in_a_batch(kind: str) -> None:
    """With the kernels' products (blocks, float16), which sum each row alone, the layer's
    routing, grouping by expert and fixed-order sum leave a row's bits its own."""
    weights, config = random_weights(kind), moe_config()
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(1))
    together = moe_mlp(x, weights, config, kernels=native.available())
    for row in (0, 5, 22):
        alone = moe_mlp(x[row : row + 1].clone(), weights, config, kernels=native.available())
        assert torch.equal(alone[0], together[row]), f"row {row} differs by {(alone[0] - together[row]).abs().max():.2e}"
    # Reordered batch-mates: each row still gets its own bits.
    order = torch.randperm(23, generator=torch.Generator().manual_seed(2))
    assert torch.equal(moe_mlp(x[order].contiguous(), weights, config, kernels=native.available()), together[order])


def test_the_output_is_the_weighted_sum_of_the_routed_experts_and_the_gated_shared_expert() -> None:
    """The textbook formula, one row at a time, in float64."""
    weights, config = random_weights(), moe_config()
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    got = moe_mlp(x, weights, config, kernels=False)
    for t in range(9):
        row = x[t].double()
        probabilities = torch.softmax(weights.router.double() @ row, dim=0)
        top, chosen = probabilities.topk(3)
        top = top / top.sum()
        want = torch.zeros(HIDDEN, dtype=torch.float64)
        for p, e in zip(top, chosen):
            gate, up = (weights.gate_up[e].double() @ row).chunk(2)  # type: ignore[union-attr]
            want += p * (weights.down[e].double() @ (torch.nn.functional.silu(gate) * up))  # type: ignore[union-attr]
        gate, up = (weights.shared_gate_up.double() @ row).chunk(2)  # type: ignore[union-attr]
        shared = weights.shared_down.double() @ (torch.nn.functional.silu(gate) * up)  # type: ignore[union-attr]
        want += torch.sigmoid(weights.shared_gate.double() @ row) * shared  # type: ignore[union-attr]
        torch.testing.assert_close(got[t].double(), want, atol=1e-5, rtol=1e-5)


def test_each_expert_of_stacked_blocks_is_a_view_of_them() -> None:
    stacked = q8_0_experts(torch.randn(EXPERTS, 2 * WIDTH, HIDDEN))
    experts = expert_weights(stacked, EXPERTS, FLOAT32)
    base, row_bytes = stacked.data.data_ptr(), stacked.data.shape[1]
    for e, expert in enumerate(experts):
        assert isinstance(expert, QuantizedWeight)
        assert (expert.out_features, expert.in_features) == (2 * WIDTH, HIDDEN)
        assert expert.data.data_ptr() == base + e * 2 * WIDTH * row_bytes
        assert expert.data.untyped_storage().data_ptr() == stacked.data.untyped_storage().data_ptr()


def test_each_expert_of_a_float32_stack_is_a_view_of_it() -> None:
    stacked = torch.randn(EXPERTS, HIDDEN, WIDTH)
    for e, expert in enumerate(expert_weights(stacked, EXPERTS, FLOAT32)):
        assert isinstance(expert, torch.Tensor) and expert.data_ptr() == stacked[e].data_ptr()
