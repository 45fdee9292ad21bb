"""Which part of each weight a tensor-parallel rank holds (Megatron-LM's column and row split).

Per decoder layer, for rank r of N:

- q/k/v (and their biases) are split by heads: rank r holds query heads
  ``r * H/N .. (r + 1) * H/N - 1`` and the KV heads they attend with (grouped-query attention
  keeps the groups whole, since N divides both counts), so attention runs locally on its heads
  and each rank's KV pool holds those heads under the same block ids;
- o is split by its input columns (the same heads): each rank's output is a partial sum, and
  one all-reduce after o makes the residual stream whole again;
- multi-head latent attention (DeepSeek-V2/V3, engine/layers/latent_attention.py) is split by
  heads too: q_b (or q_proj) and kv_b by their head-major rows, rank r's heads' [nope | rope]
  queries and [nope key | value] up-projections, o by the same heads' input columns. q_a,
  kv_a_with_mqa and their norms are replicated: the latent and the rope key are one per token,
  shared by every head, so each rank computes them whole and its KV pool keeps the whole latent
  row of every token (c + r per layer, as at tensor_parallel 1: the pool is not 1/N as with
  per-head K/V). Both of its forms run per rank on its heads: the absorbed one's per-head
  W_uk / W_uv blocks are slices of the rank's kv_b rows, the decompressed one expands the latent
  through them;
- gate/up are split by rows (columns of the intermediate activation), down by its input columns,
  with one all-reduce after down;
- a mixture-of-experts MLP is split the same way inside every expert, as vLLM's tensor-parallel
  MoE does: each rank holds 1/N of every expert's intermediate columns (its gate rows and its up
  rows of `experts.gate_up_proj`, its input columns of `experts.down_proj`) and of the shared
  expert's; the router and the shared expert's gate are replicated, so every rank routes every
  row alike, and the one all-reduce after the MLP sums the routed and shared partial outputs;
- gpt-oss's additions: the attention sinks go with their query heads, each expert's gate/up
  bias with its gate and up rows; o_proj's bias is replicated (the model adds it once, after
  the all-reduce) and the experts' down bias is rank 0's alone (zeros on the others), so that
  the sum over the ranks adds it once;
- the LM head is split into the contiguous vocabulary shards ``shard_bounds(V, N)`` the
  vocabulary-parallel sampler works on (vocab_round.py), never gathered into a full row (a
  tied head is the embedding's rows of the shard);
- the embedding and every norm are replicated. The embedding lookup is a copy of a few rows, not
  arithmetic: splitting it by vocabulary would save V * hidden / N values per rank (the default
  model: 57 MB of 16-bit weights) at the cost of a masked lookup and an all-reduce of every
  round's [tokens, hidden] activations, the largest tensor of a prompt chunk.

A quantized weight is split only at block boundaries: rows split freely (each row is its own
blocks), input columns only when each rank's share is whole blocks; anything else is refused at
start, naming the tensor. A tensor-parallel size that does not divide the heads and the KV heads
is refused naming both counts (latent attention's, which has no KV heads of its own: num_heads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import gguf
import torch

from flare.engine.model import DecoderModel
from flare.engine.quantized import QuantizedWeight
from flare.sampler.distribution import shard_bounds
from flare.package.model_config import ModelConfig

Tensor = torch.Tensor | QuantizedWeight

# Latent attention's q_b_proj [H (n + r), q_lora_rank] and kv_b_proj [H (n + v), c] are head-major
# like q/k/v: an even split of their rows is a split by heads.
_BY_HEADS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj")
_BY_ROWS = ("mlp.gate_proj", "mlp.up_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
_BY_INPUT = ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_expert.down_proj", "mlp.experts.down_proj")
_EXPERTS_GATE_UP = ".mlp.experts.gate_up_proj.weight"
_EXPERTS_GATE_UP_BIAS = ".mlp.experts.gate_up_proj.bias"
_EXPERTS_DOWN_BIAS = ".mlp.experts.down_proj.bias"
_SINKS = ".self_attn.sinks"


class TensorParallelError(ValueError):
    """A model that cannot be split N ways; the message names what does not divide."""


def check_tensor_parallel(config: ModelConfig, tensor_parallel: int) -> None:
    """Refuse a size that does not divide the heads, the KV heads or the MLP width."""
    if tensor_parallel < 1:
        raise TensorParallelError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
    if config.latent_attention is not None and config.num_heads % tensor_parallel:
        # num_kv_heads is num_heads here (`ModelConfig`): the one count to name.
        raise TensorParallelError(
            f"tensor_parallel {tensor_parallel} must divide the model's num_heads of {config.num_heads} "
            "(latent attention splits its heads over the ranks; each rank keeps the whole latent KV row)"
        )
    if config.num_heads % tensor_parallel or config.num_kv_heads % tensor_parallel:
        raise TensorParallelError(
            f"tensor_parallel {tensor_parallel} must divide both the model's {config.num_heads} attention heads "
            f"and its {config.num_kv_heads} KV heads"
        )
    if config.intermediate_size % tensor_parallel:
        raise TensorParallelError(
            f"tensor_parallel {tensor_parallel} must divide the model's MLP width of {config.intermediate_size}"
        )
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, name) % tensor_parallel:
            raise TensorParallelError(
                f"tensor_parallel {tensor_parallel} must divide the model's {name} of {getattr(config, name)}"
            )
    if any(end <= start for start, end in shard_bounds(config.vocab_size, tensor_parallel)):
        raise TensorParallelError(
            f"a vocabulary of {config.vocab_size} tokens has an empty shard at tensor_parallel {tensor_parallel}"
        )


def rank_config(config: ModelConfig, tensor_parallel: int) -> ModelConfig:
    """The config a rank's model is built with: its share of the heads, KV heads and MLP width
    (its KV pool then holds its own heads, under the block ids rank 0 allocates; with latent
    attention its `kv_layout` is the whole latent row, whatever its share of the heads)."""
    check_tensor_parallel(config, tensor_parallel)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tensor_parallel,
        num_kv_heads=config.num_kv_heads // tensor_parallel,
        intermediate_size=config.intermediate_size // tensor_parallel,
        moe_intermediate_size=config.moe_intermediate_size // tensor_parallel,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // tensor_parallel,
    )


def vocabulary_rows(config: ModelConfig, rank: int, tensor_parallel: int) -> tuple[int, int]:
    """The rank's rows of the LM head: its vocabulary shard."""
    return shard_bounds(config.vocab_size, tensor_parallel)[rank]


def rank_state_dict(
    config: ModelConfig, state_dict: Mapping[str, Tensor], rank: int, tensor_parallel: int
) -> dict[str, Tensor]:
    """Rank ``rank``'s part of every layer's tensors, the shapes of ``rank_config``: views,
    except a quantized weight's input-column share, which is copied once into contiguous rows
    of blocks. The embedding and the LM head stay whole here; the model keeps only the LM
    head's ``vocabulary_rows`` (`DecoderModel(lm_head_rows=...)`, a view)."""
    check_tensor_parallel(config, tensor_parallel)
    if not 0 <= rank < tensor_parallel:
        raise ValueError(f"rank must be between 0 and {tensor_parallel - 1}, got {rank}")
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        part = _part_of(name)
        if name.endswith(_EXPERTS_GATE_UP):
            out[name] = _expert_gate_up_rows(tensor, config.num_experts, rank, tensor_parallel)
        elif name.endswith(_EXPERTS_GATE_UP_BIAS):
            assert isinstance(tensor, torch.Tensor), f"{name} is never kept as blocks"
            width = tensor.shape[1] // 2
            start, end = _even(width, rank, tensor_parallel)
            out[name] = torch.cat((tensor[:, start:end], tensor[:, width + start : width + end]), dim=1)
        elif name.endswith(_EXPERTS_DOWN_BIAS):
            assert isinstance(tensor, torch.Tensor), f"{name} is never kept as blocks"
            out[name] = tensor if rank == 0 else torch.zeros_like(tensor)
        elif name.endswith(_SINKS):
            out[name] = _rows(tensor, *_even(_rows_of(tensor), rank, tensor_parallel))
        elif part in ("by_heads", "by_rows"):
            out[name] = _rows(tensor, *_even(_rows_of(tensor), rank, tensor_parallel))
        elif part == "by_input":
            out[name] = _columns(name, tensor, *_even(_columns_of(tensor), rank, tensor_parallel))
        else:
            out[name] = tensor
    return out


def rank_model(
    config: ModelConfig,
    state_dict: Mapping[str, Tensor],
    rank: int,
    tensor_parallel: int,
    all_reduce: Callable[[torch.Tensor], None],
    **options: Any,
) -> DecoderModel:
    """The rank's model: its heads and MLP columns, its vocabulary shard of the LM head, and
    ``all_reduce`` after o and after down. ``options`` are DecoderModel's (device, dtype, ...)."""
    return DecoderModel(
        rank_config(config, tensor_parallel),
        rank_state_dict(config, state_dict, rank, tensor_parallel),
        all_reduce=all_reduce,
        lm_head_rows=vocabulary_rows(config, rank, tensor_parallel),
        **options,
    )


def _part_of(name: str) -> str:
    """How the tensor ``name`` is split (q/k/v biases with their weights; o has no bias)."""
    if not name.startswith("model.layers."):
        return "replicated"
    if any(f".{module}." in name for module in _BY_HEADS):
        return "by_heads"
    if any(f".{module}." in name for module in _BY_ROWS):
        return "by_rows"
    if any(f".{module}.weight" in name for module in _BY_INPUT):
        return "by_input"
    return "replicated"


def _expert_gate_up_rows(tensor: Tensor, experts: int, rank: int, parts: int) -> Tensor:
    """The rank's rows of stacked experts' gate/up [E, 2 I, hidden]: of every expert, its share
    of the gate rows then the same share of the up rows, [E, 2 I / N, hidden] (copied once: the
    rows are not contiguous)."""
    rows = _rows_of(tensor) // experts if isinstance(tensor, QuantizedWeight) else tensor.shape[1]
    width = rows // 2
    start, end = _even(width, rank, parts)
    index = torch.tensor(
        [e * rows + half * width + row for e in range(experts) for half in (0, 1) for row in range(start, end)], dtype=torch.int64
    )
    if isinstance(tensor, QuantizedWeight):
        return QuantizedWeight.from_blocks(tensor.ggml_type, tensor.data.index_select(0, index), len(index), tensor.in_features)
    return tensor.reshape(experts * rows, -1).index_select(0, index).view(experts, 2 * (end - start), -1)


def _even(size: int, rank: int, parts: int) -> tuple[int, int]:
    share = size // parts
    return rank * share, (rank + 1) * share


def _rows_of(tensor: Tensor) -> int:
    return tensor.out_features if isinstance(tensor, QuantizedWeight) else tensor.shape[0]


def _columns_of(tensor: Tensor) -> int:
    return tensor.in_features if isinstance(tensor, QuantizedWeight) else tensor.shape[-1]


def _rows(tensor: Tensor, start: int, end: int) -> Tensor:
    return tensor.rows(start, end) if isinstance(tensor, QuantizedWeight) else tensor[start:end]


def _columns(name: str, tensor: Tensor, start: int, end: int) -> Tensor:
    if not isinstance(tensor, QuantizedWeight):
        return tensor[..., start:end]  # stacked experts [E, hidden, I] too
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.ggml_type]
    if start % block_size or end % block_size:
        raise TensorParallelError(
            f"{name}: a {tensor.ggml_type.name} weight is stored in blocks of {block_size} input columns, and a "
            f"rank's share of its {tensor.in_features} columns ({end - start}) is not whole blocks"
        )
    # The kernels read whole contiguous rows of blocks: the rank's columns are copied once, at
    # load (1/N of the weight).
    data = tensor.data[:, start // block_size * type_size : end // block_size * type_size].contiguous()
    return QuantizedWeight.from_blocks(tensor.ggml_type, data, tensor.out_features, end - start, tensor.activations)
