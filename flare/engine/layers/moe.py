"""The mixture-of-experts MLP (Qwen2/3-MoE, Mixtral; the routing of DeepSeek and gpt-oss too):
a router picks k of E gated MLPs ("experts") per token, and the token's output is their outputs
summed, weighted by the router, plus a shared expert every token runs where the model has one.

    out(x) = sum over the k experts e of x, in ascending e:  w_e(x) * down_e(act(gate_e(x)) * up_e(x))
             + [sigmoid(shared_gate . x)] * shared(x)

gpt-oss's experts add a bias to gate/up and to down, and their act(gate) * up is the clamped
SwiGLU (`mlp.clamped_swiglu`, `ModelConfig.hidden_activation` clamped_swiglu).

The route is float32 (`routing.py`), from router logits summed in float64 and rounded once
(`router_logits`): float32 GEMMs (MKL) sum a row's products in an order that depends on how many
rows they multiply at once, which could flip a near-tie route between batches. With the kernels
the whole route is one C call (`native.moe_route`, moe_route.c: the same float64 logits and the
same choice, ties to the lower expert, weights rounded once), and both expert paths below read it. The rows of a round are grouped by expert, so each expert's
gate/up and down run once per round on all the rows routed to it, through the same linear
products as a dense layer (`mlp.gated_mlp`: float weights or ggml blocks, `linear.py`); with the
kernels and experts of ggml blocks (gpt-oss's biases and clamped SwiGLU included), the routed
experts are one C call (`native_quantized.moe_layer`, moe_layer.c: the same grouping, products and sum, so
the same bits; in a round of short rows the whole decoder layer, route and experts included, is
one C call, `native_layers.KernelMoE`), on float32 activations or, under `flare run --activations int8x2|int8`, on 8-bit
activation blocks by quantized.py's integer products (each row quantized once for every expert's
gate/up, each expert's activations once for its down). A row's
k outputs land in its own k slots and are summed slot by slot in the row's fixed expert order,
never in the order the batch grouped them: a row's result does not depend on its batch-mates
wherever its products do not (the kernels' block and float16 products; float32 and bfloat16
weights go through MKL and oneDNN, as the dense layers do, whose sums are not row-independent).

Experts are stored stacked, one tensor per projection per layer (`package.moe_weight_shapes`):
each expert's matrix is a view of it (`expert_weights`), never a copy of the mapped blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flare.engine import native, native_quantized
from flare.engine.layers.mlp import SWIGLU_ALPHA, clamped_swiglu, gated_activation, gated_mlp
from flare.engine.layers.routing import Routes, route
from flare.engine.linear import Weight, linear, linear_columns, pack_weight, stack_weights
from flare.engine.precision import WeightFormat
from flare.engine.quantized import QuantizedWeight
from flare.package.model_config import ModelConfig


@dataclass(frozen=True)
class MoEWeights:
    """One mixture-of-experts MLP's weights: the router, float32 [E, hidden] (with its bias [E]
    and DeepSeek-V3's score correction bias [E] where the model has them; kept float32, half the
    bytes a decode round streams, and widened to float64 inside the product), each expert's fused
    gate/up [2 I, hidden] and down [hidden, I] (views of the stacked tensors), and the shared
    expert and its gate [1, hidden] where the model has them."""

    router: torch.Tensor
    gate_up: tuple[Weight, ...]
    down: tuple[Weight, ...]
    router_bias: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    shared_gate_up: Weight | None = None
    shared_down: Weight | None = None
    shared_gate: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None  # float32 [E, 2 I] (gpt-oss)
    down_bias: torch.Tensor | None = None  # float32 [E, hidden] (gpt-oss)
    # The stacked experts as one weight each where they are ggml blocks (E * 2 I and E * hidden
    # rows, the same mapped bytes as `gate_up` and `down`): the one-call kernel reads them.
    gate_up_blocks: QuantizedWeight | None = None
    down_blocks: QuantizedWeight | None = None


def expert_weights(stacked: torch.Tensor | QuantizedWeight, experts: int, weight_format: WeightFormat) -> tuple[Weight, ...]:
    """Each expert's [out, in] matrix of a stacked projection: a float [E, out, in] tensor (its
    slices, packed for this CPU's GEMM where the format packs, views otherwise) or ggml blocks of
    E * out rows (each expert's rows, a view of the mapped file)."""
    if isinstance(stacked, QuantizedWeight):
        rows = stacked.out_features // experts
        return tuple(stacked.rows(e * rows, (e + 1) * rows) for e in range(experts))
    return tuple(pack_weight(stacked[e], weight_format) for e in range(experts))


def load_moe_weights(
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor | QuantizedWeight],
    prefix: str,
    weight_format: WeightFormat,
    device: torch.device,
) -> MoEWeights:
    """The MoE MLP of the tensors under `prefix` (`package.moe_weight_shapes`' names)."""

    def stacked(name: str) -> torch.Tensor | QuantizedWeight:
        tensor = state_dict[f"{prefix}.{name}"]
        return tensor if isinstance(tensor, QuantizedWeight) else tensor.to(device)

    def vector(name: str) -> torch.Tensor | None:
        tensor = state_dict.get(f"{prefix}.{name}")
        assert tensor is None or isinstance(tensor, torch.Tensor), f"{prefix}.{name} is never kept as blocks"
        return None if tensor is None else tensor.to(device=device, dtype=torch.float32).contiguous()

    def shared(name: str) -> Weight | None:
        tensors = [state_dict.get(f"{prefix}.shared_expert.{n}_proj.weight") for n in name.split("_")]
        if any(t is None for t in tensors):
            return None
        return stack_weights([t if isinstance(t, QuantizedWeight) else t.to(device) for t in tensors], weight_format)  # type: ignore[union-attr]

    router, shared_gate = vector("router.weight"), vector("shared_expert_gate.weight")
    assert router is not None
    gate_up, down = stacked("experts.gate_up_proj.weight"), stacked("experts.down_proj.weight")
    return MoEWeights(
        router=router,
        gate_up=expert_weights(gate_up, config.num_experts, weight_format),
        down=expert_weights(down, config.num_experts, weight_format),
        router_bias=vector("router.bias"),
        correction_bias=vector("router.score_correction_bias"),
        shared_gate_up=shared("gate_up"),
        shared_down=shared("down"),
        shared_gate=shared_gate,
        gate_up_bias=vector("experts.gate_up_proj.bias"),
        down_bias=vector("experts.down_proj.bias"),
        gate_up_blocks=gate_up if isinstance(gate_up, QuantizedWeight) else None,
        down_blocks=down if isinstance(down, QuantizedWeight) else None,
    )


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] @ weight^T (+ bias), float32 [T, out]: summed in float64, rounded once.

    The products of float32 values are exact in float64 and the float64 sum's error (about
    hidden * 2^-53 of the terms' magnitude) is far below float32's half ulp, so a row's logits
    are the same float32 values whatever rows share the product, unless one lies within that
    error of a float32 rounding boundary; and they are closer to the exact sum than a float32
    GEMM's."""
    logits = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return logits.float()


def moe_routes(x: torch.Tensor, weights: MoEWeights, config: ModelConfig, *, kernels: bool) -> Routes:
    """The route of each row of x [T, hidden]: with the kernels one C call (`native.moe_route`,
    the shared expert's gate factor with it), else the router's logits (`router_logits`), then
    `routing.route`."""
    if kernels and x.dtype == torch.float32:
        experts, expert_weights, shared_scale = native.moe_route(
            x.contiguous(), weights.router, config.routing, config.num_experts_per_tok, router_bias=weights.router_bias,
            correction_bias=weights.correction_bias, n_group=config.n_group, topk_group=config.topk_group,
            normalize=config.norm_topk_prob, scaling=config.routed_scaling_factor,
            shared_gate=None if weights.shared_gate is None else weights.shared_gate.view(-1),
        )
        return Routes(experts, expert_weights, shared_scale)
    return route(router_logits(x, weights.router, weights.router_bias), config, weights.correction_bias)


def _expert(rows: torch.Tensor, weights: MoEWeights, expert: int, config: ModelConfig, *, kernels: bool) -> torch.Tensor:
    """Expert `expert`'s gated MLP of `rows` [T, hidden]: `mlp.gated_mlp`, or with gpt-oss's
    biases and clamped SwiGLU where the model has them."""
    gate_up, down = weights.gate_up[expert], weights.down[expert]
    if weights.gate_up_bias is None and config.hidden_activation != "clamped_swiglu":
        return gated_mlp(rows, gate_up, down, config.hidden_activation, kernels=kernels)
    columns = linear_columns(rows, gate_up)
    if weights.gate_up_bias is not None:
        columns = columns + weights.gate_up_bias[expert].to(columns.dtype).unsqueeze(1)
    if config.hidden_activation == "clamped_swiglu":
        assert config.swiglu_limit is not None
        activated = clamped_swiglu(columns.contiguous(), limit=config.swiglu_limit, kernels=kernels)
    else:
        activated = gated_activation(columns, config.hidden_activation, kernels=kernels)
    out = linear(activated, down)
    return out if weights.down_bias is None else out + weights.down_bias[expert].to(out.dtype)


def routed_experts(x: torch.Tensor, routes: Routes, weights: MoEWeights, config: ModelConfig, *, kernels: bool) -> torch.Tensor:
    """The routed experts' weighted sum [T, hidden] in x's dtype, expert by expert in torch: the
    counterpart of `native_quantized.moe_layer`, which runs instead with kernels and experts of blocks."""
    tokens, k = routes.experts.shape
    flat = routes.experts.reshape(-1)  # slot s of row t is t * k + s
    # The slots grouped by expert (stable: in row order within an expert).
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=config.num_experts).tolist()
    slots = torch.empty(tokens * k, config.hidden_size, dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        taken = order[start : start + count]
        start += count
        rows = x.index_select(0, taken // k)
        slots[taken] = _expert(rows, weights, expert, config, kernels=kernels).to(x.dtype)
    weighted = slots.view(tokens, k, -1) * routes.weights.to(x.dtype).unsqueeze(-1)
    out = weighted[:, 0].clone()
    for slot in range(1, k):  # the fixed order: the row's experts ascending
        out += weighted[:, slot]
    return out


def experts_in_one_call(weights: MoEWeights, config: ModelConfig) -> bool:
    """Whether the routed experts run as one C call where the kernels run (`native_quantized.moe_layer`,
    and inside the one-call decoder layer): experts of blocks; float experts stay in `routed_experts`."""
    return (
        weights.gate_up_blocks is not None
        and weights.down_blocks is not None
        and config.hidden_activation in native.EXPERT_ACTIVATION_CODES
    )


def expert_swiglu(config: ModelConfig) -> tuple[float, float] | None:
    """The clamped SwiGLU's (alpha, limit) as the experts' one call takes them (`_expert`'s), or None."""
    if config.hidden_activation != "clamped_swiglu":
        return None
    assert config.swiglu_limit is not None
    return (SWIGLU_ALPHA, config.swiglu_limit)


def moe_mlp(x: torch.Tensor, weights: MoEWeights, config: ModelConfig, *, kernels: bool) -> torch.Tensor:
    """The MoE MLP of rows x [T, hidden]: [T, hidden] in x's dtype (module docstring)."""
    routes = moe_routes(x, weights, config, kernels=kernels)
    if kernels and x.dtype == torch.float32 and experts_in_one_call(weights, config):
        gate_up, down = weights.gate_up_blocks, weights.down_blocks
        assert gate_up is not None and down is not None
        out = native_quantized.moe_layer(
            x.contiguous(), routes.experts.contiguous(), routes.weights.contiguous(), gate_up.data, gate_up.ggml_type,
            down.data, down.ggml_type, config.num_experts, config.hidden_activation,
            gate_up_halves=gate_up.halves, down_halves=down.halves, swiglu=expert_swiglu(config),
            gate_up_bias=weights.gate_up_bias, down_bias=weights.down_bias,
        )
    else:
        out = routed_experts(x, routes, weights, config, kernels=kernels)
    if weights.shared_gate_up is not None and weights.shared_down is not None:
        shared = gated_mlp(x, weights.shared_gate_up, weights.shared_down, config.hidden_activation, kernels=kernels)
        if weights.shared_gate is not None:
            scale = routes.shared_scale
            if scale is None:  # the torch route's: the gate's logit rounded to float32, then its sigmoid
                scale = torch.sigmoid(router_logits(x, weights.shared_gate)).view(-1)
            shared = scale.to(x.dtype).unsqueeze(1) * shared
        out += shared
    return out
