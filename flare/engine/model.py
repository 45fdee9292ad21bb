"""One decoder for every family flare serves, over a paged KV cache.

Its layer is Llama's (RMSNorm, RoPE, grouped-query attention, SwiGLU), composed of the layers of
`layers/` (attention, RoPE, the gated MLP, norms: a file each); what each other family adds is a
field of `ModelConfig` and an option of those layers, never a model per family
(gpt-fast's one model.py is the pattern): q/k/v biases (Qwen2), per-head q/k RMSNorm before RoPE
(Qwen3, Gemma 3), RoPE scalings and partial rotary (layers/rope.py), sliding windows per layer with
their own RoPE base (Mistral, Gemma 2/3), attention scale and soft-caps and sandwich norms and the
embedding scale (Gemma), GeGLU (Gemma), the o_proj bias and attention sinks (gpt-oss), MoE layers
(layers/moe.py). Each matches transformers' eager attention math. The C
kernels implement every family's layer (`kernels_fit`), each feature an option of the kernel
that runs the step Llama has.

The forward pass takes one ragged `ForwardBatch` (prompt chunks, decode rows and verify rows
together) and returns logits only for the positions that need them. The layout choices that make
it fast on a CPU, where a round of 32 decode rows is bound by the linear layers:

- q/k/v and gate/up are fused into one matrix each at load time (one GEMM instead of three/two);
- linear layers run on the flat token dimension, with no padding, weights first (`linear.py`);
- short rows of the same length share one attention call per layer (see batch.py);
- four steps of a layer run as C kernels on a float32 CPU model where they were built
  (`native.py`): attention of short rows read straight from the pool, RoPE with the KV write,
  SwiGLU, and the residual add with the norm after it. Their torch counterparts in `layers/` run
  elsewhere, and for long prompt chunks' attention (gathered a block at a time,
  `layers/attention.py`);
- RoPE cos/sin come from a table built once; the torch path gathers them once per round;
- linear layers run in a weight format chosen per CPU (`precision.py`): float16 through the
  engine's kernel on x86 CPUs with AVX2, bfloat16 through oneDNN where asked for, float32
  through MKL; the weights are stored and multiplied in it, everything between the GEMMs stays float32;
- on float16 or block weights a round of short rows runs all its layers in one kernel call
  (`native_layers.LayerStack`), the same kernels as the steps of `forward_hidden` without the
  Python between them, a mixture-of-experts MLP of blocks included (gpt-oss's sinks, o bias,
  expert biases and clamped SwiGLU, and a shared expert with its gate, too);
- a package's quantized tensors stay ggml blocks mapped from its file (`quantized.py`): their
  linear layers multiply float32 activations straight from the blocks, the embedding
  dequantizes only the rows it looks up, and a tied LM head is the embedding's blocks. Their
  layers run through that call too, each linear layer float16 or blocks or parts of both (the
  q/k/v of a Q4_K_M layer whose v is Q6_K).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flare.engine import native, native_layers, precision, quantized
from flare.engine.precision import WeightFormat
from flare.engine.quantized import QuantizedWeight, dequantize as dequantized_weight
from flare.engine.batch import ForwardBatch
from flare.engine.kv_cache import KVCache
from flare.engine.layers.attention import AttentionCall, PagedAttention, rope_and_cache
from flare.engine.layers.latent_attention import LatentWeights, latent_attention
from flare.engine.layers.mlp import gated_mlp
from flare.engine.layers.moe import MoEWeights, expert_swiglu, experts_in_one_call, load_moe_weights, moe_mlp
from flare.engine.layers.norms import add_norm, sublayer_output
from flare.engine.layers.rope import rope_tables, round_tables
from flare.engine.linear import Weight, linear, linear_columns, packs, stack_weights
from flare.package.blocks import dequantized
from flare.package.model_config import ModelConfig
from flare.package.directory import TORCH_DTYPES, Package, expected_weight_shapes, fits_float16, weight_problems
from flare.package.problems import capped


class WeightsError(ValueError):
    """A state dict that does not match the model config (names every problem)."""


@dataclass(frozen=True)
class DecoderLayer:
    """One layer's weights; linear weights are [out, in], as checkpoints store them."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim, hidden]; None with latent attention
    o: torch.Tensor  # [hidden, heads * head_dim] (heads * v_head_dim with latent attention)
    post_norm: torch.Tensor  # [hidden]
    gate_up: Weight | None  # [2 * intermediate, hidden]; None in a mixture-of-experts layer
    down: Weight | None  # [hidden, intermediate]; None in a mixture-of-experts layer
    # What a family adds (`ModelConfig`); None where the layer has none of it.
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    attention_output_norm: torch.Tensor | None = None  # [hidden]
    mlp_output_norm: torch.Tensor | None = None  # [hidden]
    window: int | None = None  # the sliding window its queries attend in, where it narrows the context
    local_rope: bool = False  # RoPE from the sliding layers' own table (`local_rope_theta`)
    latent: LatentWeights | None = None  # latent attention's projections (DeepSeek), in place of qkv
    moe: MoEWeights | None = None  # the mixture-of-experts MLP that replaces gate_up/down (`layers/moe.py`)
    o_bias: torch.Tensor | None = None  # [hidden] (gpt-oss)
    sinks: torch.Tensor | None = None  # float32 [heads], each head's attention sink logit (gpt-oss)


def _shape(weight: torch.Tensor | QuantizedWeight, expected: tuple[int, ...] | None) -> tuple[int, ...]:
    """The weight's shape; blocks of stacked experts (rows of every expert, [E * out, in]) read as
    the [E, out, in] they hold where the rows add up to it."""
    if not isinstance(weight, QuantizedWeight):
        return tuple(weight.shape)
    if expected is not None and len(expected) == 3 and weight.out_features == expected[0] * expected[1]:
        return (expected[0], expected[1], weight.in_features)
    return (weight.out_features, weight.in_features)


def check_state_dict(config: ModelConfig, state_dict: Mapping[str, torch.Tensor | QuantizedWeight]) -> None:
    """Raise `WeightsError` listing every missing, unexpected or misshapen weight."""
    expected = expected_weight_shapes(config)
    problems = weight_problems(config, {name: _shape(tensor, expected.get(name)) for name, tensor in state_dict.items()})
    if problems:
        raise WeightsError("the weights do not match the model config: " + "; ".join(capped(problems)))


def _linear_parts(weight: Weight) -> tuple[native_layers.LinearPart, ...] | None:
    """A linear layer's weight as `native_layers.decoder_layer` multiplies it, or None for a kind it
    does not (plain, oneDNN or fbgemm weights)."""
    if isinstance(weight, native.Float16Weight):
        return (native_layers.LinearPart.float16(weight),)
    if isinstance(weight, QuantizedWeight):
        return (
            native_layers.LinearPart(
                int(weight.ggml_type), weight.data, weight.out_features, weight.in_features, halves=weight.halves
            ),
        )
    if isinstance(weight, tuple):
        parts = [_linear_parts(part) for part in weight]
        if all(p is not None for p in parts) and sum(len(p) for p in parts) <= native_layers.LAYER_LINEAR_PARTS:  # type: ignore[arg-type]
            return tuple(part for p in parts for part in p)  # type: ignore[union-attr]
    return None


def _kernel_layers(
    layers: list[DecoderLayer], config: ModelConfig, local_rope: tuple[torch.Tensor, torch.Tensor] | None
) -> list[native_layers.KernelLayer] | str:
    """The layers as `native_layers.decoder_layer` reads them, with their family features (the sliding
    layers of a model with its own local base on `local_rope`'s tables) and their mixture-of-experts
    MLPs (`_kernel_moe`), where every linear layer of every layer is float16 or ggml blocks;
    otherwise why not (the layers then run step by step)."""
    if config.latent_attention is not None:
        return "latent attention is not in the one-call layer"
    kernel_layers = []
    for layer in layers:
        moe = None if layer.moe is None else _kernel_moe(layer.moe, config)
        if layer.moe is not None and moe is None:
            return "a MoE layer's experts are float weights"
        linears = [_linear_parts(w) for w in (layer.qkv, layer.o)]
        mlp = (layer.gate_up, layer.down) if layer.moe is None else (layer.moe.shared_gate_up, layer.moe.shared_down)
        linears += [() if w is None else _linear_parts(w) for w in mlp]
        if any(parts is None for parts in linears):
            return "a linear layer is neither float16 nor ggml blocks"
        cos, sin = local_rope if layer.local_rope and local_rope is not None else (None, None)
        kernel_layers.append(
            native_layers.KernelLayer(
                layer.input_norm,
                layer.post_norm,
                *linears,  # type: ignore[arg-type]
                qkv_bias=layer.qkv_bias,
                q_norm=layer.q_norm,
                k_norm=layer.k_norm,
                attention_output_norm=layer.attention_output_norm,
                mlp_output_norm=layer.mlp_output_norm,
                cos=cos,
                sin=sin,
                window=layer.window,
                softcap=config.attention_softcap,
                scale=config.attention_scale,
                activation=config.hidden_activation,
                sinks=layer.sinks,
                o_bias=layer.o_bias,
                moe=moe,
            )
        )
    return kernel_layers


def _kernel_moe(moe: MoEWeights, config: ModelConfig) -> native_layers.KernelMoE | None:
    """A mixture-of-experts MLP as the one-call kernel layer runs it (`native_layers.KernelMoE`):
    the route and the experts' call that `moe.moe_mlp` makes with kernels and experts of blocks;
    None where that function takes another path (experts of float weights). A shared expert is the
    kernel layer's gate_up and down (`_kernel_layers`), its gate here."""
    gate_up, down = moe.gate_up_blocks, moe.down_blocks
    if not experts_in_one_call(moe, config) or gate_up is None or down is None:
        return None
    return native_layers.KernelMoE(
        moe.router, gate_up.data, int(gate_up.ggml_type), down.data, int(down.ggml_type), config.routing,
        config.num_experts_per_tok, router_bias=moe.router_bias, correction_bias=moe.correction_bias, n_group=config.n_group,
        topk_group=config.topk_group, normalize=config.norm_topk_prob, scaling=config.routed_scaling_factor,
        gate_up_halves=gate_up.halves, down_halves=down.halves, activation=config.hidden_activation,
        swiglu=expert_swiglu(config), gate_up_bias=moe.gate_up_bias, down_bias=moe.down_bias,
        shared_gate=None if moe.shared_gate is None else moe.shared_gate.view(-1),
    )


def kernels_fit(config: ModelConfig) -> bool:
    """Whether the C kernels (`native.*`, `native_layers.decoder_layers`) implement every step of the
    layers `config` describes. Every family's features are options of the kernels; only heads
    wider than the kernels keep on their stack for those options (`native.FEATURES_MAX_HEAD_DIM`)
    run on the torch path (`DecoderModel.forward_hidden`). Latent attention's own steps are torch
    around one kernel (`latent_attention.py`), its MLPs and norms the kernels'."""
    featured = config.attention_bias or config.qk_norm or config.rotary_dims != config.head_dim
    return not featured or config.head_dim <= native.FEATURES_MAX_HEAD_DIM


class DecoderModel:
    """The weights of a decoder of any family flare serves and its forward pass over a paged KV
    cache: Llama's layer, with each family's additions (`ModelConfig`) as torch steps.

    Linear weights are kept [out, in] in the model's `weight_format` and applied by `linear`,
    the LM head too (for tied weights it is the embedding itself, shared, not copied, unless
    the weights are packed).
    """

    def __init__(
        self,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor | QuantizedWeight],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        weight_format: WeightFormat | None = None,
        native_kernels: bool | None = None,
        context: int | None = None,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        lm_head_rows: tuple[int, int] | None = None,
        absorbed_attention: bool | None = None,
    ) -> None:
        """`dtype`: activations and norms, and what attention computes in (the KV cache holds
        `dtype`, or float16 / bfloat16 widened when read). `weight_format`: what the linear layers'
        weights (the embedding too, which is the tied LM head) are stored and multiplied as
        (`precision.py`); `dtype`'s own format if None.
        `native_kernels`: run attention of short rows, RoPE with the cache write, and SwiGLU
        with the CPU kernels of `native` (True), with their torch counterparts (False), or with
        the kernels where they were built and apply (None); they apply where `kernels_fit`.
        `context`: the longest context the model will serve (default: its own); a sliding
        window at least as long narrows nothing, and longrope picks its factors by it.
        `all_reduce`, `lm_head_rows`: a tensor-parallel rank (flare/parallel/tensor_split.py),
        whose `config` and `state_dict` hold its share of the heads and of the MLP width;
        `all_reduce` sums a sublayer's partial output over the ranks in place, after o and after
        down (before a sandwich norm, which needs the whole output), and the LM head is the
        vocabulary rows `lm_head_rows` (the logits of the rank's vocabulary shard). Its layers
        run step by step: the one-call kernel layer has no point to all-reduce at.
        `absorbed_attention`: latent attention's form for every call, absorbed (True) or
        decompressed (False); None: per call by its rows' length (`latent_attention.absorbed_for`)."""
        check_state_dict(config, state_dict)
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_format = weight_format or WeightFormat(precision.dtype_name(dtype))
        # The kernels are float32 and CPU only.
        applies = self.device.type == "cpu" and dtype == torch.float32
        self.context = config.max_position_embeddings if context is None else min(context, config.max_position_embeddings)
        fits = kernels_fit(config)
        if native_kernels and not (applies and native.available() and fits):
            raise ValueError(
                "the native CPU kernels need a float32 model on the CPU, the built extension and "
                f"layers they implement (model: {dtype} on {self.device}; extension built: "
                f"{native.available()}; layers fit: {fits})"
            )
        self.native_kernels = applies and native.available() and fits if native_kernels is None else native_kernels
        weights_dtype = self.weight_format.dtype

        if any(isinstance(w, QuantizedWeight) for w in state_dict.values()) and self.device.type != "cpu":
            raise ValueError(f"quantized blocks are multiplied on the CPU only, not on {self.device}")

        def weight(name: str, as_dtype: torch.dtype) -> torch.Tensor:
            tensor = state_dict[name]
            assert isinstance(tensor, torch.Tensor), f"{name} is a vector and is never kept as blocks"
            return tensor.to(device=self.device, dtype=as_dtype).contiguous()

        def linear_weight(*names: str) -> Weight:
            """The [out, in] weights of `names` stacked on `out` (one GEMM instead of several)."""
            parts = [state_dict[n] for n in names]
            return stack_weights([p if isinstance(p, QuantizedWeight) else p.to(self.device) for p in parts], self.weight_format)

        # The embedding is looked up by row, which a packed weight cannot be: a tied LM head is
        # then a packed copy of it (56 MB more for the default model in a 16-bit format). Blocks
        # are looked up and multiplied as they are: a tied LM head is the embedding's blocks.
        embedding = state_dict["model.embed_tokens.weight"]
        self.embed: torch.Tensor | QuantizedWeight = (
            embedding if isinstance(embedding, QuantizedWeight) else weight("model.embed_tokens.weight", weights_dtype)
        )
        head_rows = lm_head_rows or (0, config.vocab_size)

        def head_weight(name: str) -> Weight:
            tensor = state_dict[name]
            part = tensor.rows(*head_rows) if isinstance(tensor, QuantizedWeight) else tensor[slice(*head_rows)].to(self.device)
            return stack_weights([part], self.weight_format)

        if not config.tie_word_embeddings:
            self.lm_head = head_weight("lm_head.weight")
        elif packs(self.weight_format, self.device):
            self.lm_head = head_weight("model.embed_tokens.weight")
        elif lm_head_rows is None:
            self.lm_head = self.embed
        elif isinstance(self.embed, QuantizedWeight):
            self.lm_head = self.embed.rows(*head_rows)
        else:
            self.lm_head = self.embed[slice(*head_rows)]
        self.all_reduce = all_reduce
        self.norm = weight("model.norm.weight", dtype)

        def optional(name: str) -> torch.Tensor | None:
            return weight(name, dtype) if name in state_dict else None

        def latent(prefix: str) -> LatentWeights:
            spec = config.latent_attention
            assert spec is not None
            kv_b = state_dict[f"{prefix}.kv_b_proj.weight"]
            # The absorbed form multiplies by kv_b's per-head blocks (float, `dtype`).
            kv_b_values = (dequantized_weight(kv_b) if isinstance(kv_b, QuantizedWeight) else kv_b).to(self.device, dtype)
            per_head = kv_b_values.view(config.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
            low_rank = spec.q_lora_rank is not None
            return LatentWeights(
                q_a_kv_a=linear_weight(
                    *((f"{prefix}.q_a_proj.weight",) if low_rank else ()), f"{prefix}.kv_a_proj_with_mqa.weight"
                ),
                q_a_norm=weight(f"{prefix}.q_a_layernorm.weight", dtype) if low_rank else None,
                q=linear_weight(f"{prefix}.q_b_proj.weight" if low_rank else f"{prefix}.q_proj.weight"),
                kv_a_norm=weight(f"{prefix}.kv_a_layernorm.weight", dtype),
                kv_b=linear_weight(f"{prefix}.kv_b_proj.weight"),
                k_up=per_head[:, : spec.qk_nope_head_dim].contiguous(),
                v_up=per_head[:, spec.qk_nope_head_dim :].contiguous(),
            )

        def layer(i: int) -> DecoderLayer:
            prefix = f"model.layers.{i}"
            window = config.layer_window(i)
            mla = config.latent_attention is not None
            moe = config.is_moe_layer(i)
            return DecoderLayer(
                input_norm=weight(f"{prefix}.input_layernorm.weight", dtype),
                qkv=None if mla else linear_weight(*(f"{prefix}.self_attn.{p}_proj.weight" for p in "qkv")),
                latent=latent(f"{prefix}.self_attn") if mla else None,
                o=linear_weight(f"{prefix}.self_attn.o_proj.weight"),
                post_norm=weight(f"{prefix}.post_attention_layernorm.weight", dtype),
                gate_up=None if moe else linear_weight(f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight"),
                down=None if moe else linear_weight(f"{prefix}.mlp.down_proj.weight"),
                moe=load_moe_weights(config, state_dict, f"{prefix}.mlp", self.weight_format, self.device) if moe else None,
                qkv_bias=torch.cat([weight(f"{prefix}.self_attn.{p}_proj.bias", dtype) for p in "qkv"])
                if config.attention_bias
                else None,
                q_norm=optional(f"{prefix}.self_attn.q_norm.weight"),
                k_norm=optional(f"{prefix}.self_attn.k_norm.weight"),
                attention_output_norm=optional(f"{prefix}.attention_output_norm.weight"),
                mlp_output_norm=optional(f"{prefix}.mlp_output_norm.weight"),
                # Positions are below the context served: a window at least that long hides nothing.
                window=window if window is not None and window < self.context else None,
                local_rope=window is not None and config.local_rope_theta is not None,
                o_bias=optional(f"{prefix}.self_attn.o_proj.bias"),
                sinks=weight(f"{prefix}.self_attn.sinks", torch.float32) if config.attention_sinks else None,
            )

        self.layers = [layer(i) for i in range(config.num_layers)]
        self.absorbed_attention = absorbed_attention
        # The one window the sliding layers share, where it narrows anything (`PagedAttention.plan`).
        self.window = next((layer.window for layer in self.layers if layer.window is not None), None)
        self.attention = PagedAttention(config, kernels=self.native_kernels, window=self.window, device=self.device, dtype=dtype)
        # A round of short rows on float16 or block weights runs each layer as one kernel call
        # (`native_layers.decoder_layer`): the same kernels as the steps below, without the Python
        # between them.
        self.rope_cos, self.rope_sin = rope_tables(config, dtype, self.device, context=self.context)
        # The sliding layers' own table, where they have their own base (Gemma 3).
        self.local_rope = (
            rope_tables(config, dtype, self.device, local=True, context=self.context)
            if any(layer.local_rope for layer in self.layers)
            else None
        )
        # A tensor-parallel rank runs its layers step by step: the one-call layer has no point to
        # all-reduce at.
        if not self.native_kernels:
            built: list[native_layers.KernelLayer] | str = "the C kernels do not run"
        elif all_reduce is not None:
            built = "a tensor-parallel rank sums each sublayer across the ranks"
        else:
            built = _kernel_layers(self.layers, config, self.local_rope)
        self.kernel_layers = None if isinstance(built, str) else built
        # How a round of short rows runs its layers, as `engine_loaded` reports it.
        self.layer_calls = "one call" if self.kernel_layers is not None else f"steps: {built}"
        self._layer_scratch = torch.empty(0, dtype=torch.float32, device=self.device)
        self._stack: native_layers.LayerStack | None = None  # kernel_layers with the KV pools they last ran on

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run one round: write every new token's K/V into the cache and return float32 logits
        [batch.num_logits, vocab] for the rows' last `num_logits` positions, in row order."""
        return self.forward_hidden(batch, kv_cache)[0]

    @torch.inference_mode()
    def forward_hidden(
        self, batch: ForwardBatch, kv_cache: KVCache, inputs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning the residual stream after the last layer (before the final
        norm) of every token, [batch.num_tokens, hidden] in the batch's flat order: what a draft
        head reads. `inputs` [num_tokens, hidden] replaces the token embeddings (a draft head's
        block is fed its projection of hidden state and embedding, `drafters/mtp.py`)."""
        if kv_cache.block_size != batch.block_size:
            raise ValueError(
                f"the batch was built for blocks of {batch.block_size} tokens, the cache has {kv_cache.block_size}"
            )
        if kv_cache.dtype not in (self.dtype, torch.float16, torch.bfloat16):
            raise ValueError(
                f"the KV cache holds {kv_cache.dtype}, the model computes in {self.dtype}: "
                "create the cache in the model's dtype, float16 or bfloat16"
            )
        if batch.max_position >= self.context:
            raise ValueError(f"position {batch.max_position} is past the context served, {self.context} positions")
        if inputs is not None:
            h = inputs.to(self.dtype, copy=True).contiguous()
        elif self.config.embedding_scale != 1.0:
            # Gemma: the embeddings times sqrt(hidden), rounded to the weights' dtype as transformers does.
            scale = torch.tensor(self.config.embedding_scale, dtype=self.dtype)
            h = self.embed_rows(batch.token_ids).to(self.dtype) * scale
        else:
            h = self.embed_rows(batch.token_ids).to(self.dtype)
        config, kernels = self.config, self.native_kernels
        eps = config.rms_norm_eps
        # cos and sin of the round's positions, gathered once for every layer on the torch path:
        # from the global table, then (where the model has one) the sliding layers' own.
        tables = [(self.rope_cos, self.rope_sin)] + ([] if self.local_rope is None else [self.local_rope])
        # (latent attention rotates its rows in torch, kernels or not)
        ropes = None if kernels and config.latent_attention is None else round_tables(tables, batch.positions)
        # Latent attention gathers its own rows (layers/latent_attention.py): no plan to build.
        calls = [] if config.latent_attention is not None else self.attention.plan(batch, kv_cache)
        if self.kernel_layers is not None and all(call.native for call in calls):
            self._layer_stack(kv_cache).run(h, self._decoder_round(batch, calls, kv_cache))
        else:
            # Each sublayer's output is added to the residual stream h by the norm that reads it next.
            delta = None
            for index, layer in enumerate(self.layers):
                x = add_norm(h, delta, layer.input_norm, eps, kernels=kernels)
                keys, values = kv_cache.keys[index], kv_cache.values[index]
                if layer.latent is not None:
                    assert ropes is not None, "latent attention rotates in torch"
                    heads_out = latent_attention(
                        x, layer.latent, batch, config, keys, ropes[0], absorbed=self.absorbed_attention, kernels=kernels
                    )
                else:
                    assert layer.qkv is not None
                    q = rope_and_cache(
                        linear_columns(x, layer.qkv), batch, config, keys, values, kernels=kernels,
                        table=tables[layer.local_rope and self.local_rope is not None],
                        round_rope=None if ropes is None else ropes[layer.local_rope],
                        bias=layer.qkv_bias, q_norm=layer.q_norm, k_norm=layer.k_norm,
                    )
                    heads_out = self.attention.attend(q, keys, values, calls, layer.window, layer.sinks)
                attention = self._summed(linear(heads_out, layer.o))
                if layer.o_bias is not None:  # after the ranks' partial sums are summed: added once
                    attention = attention + layer.o_bias
                attention = sublayer_output(attention, layer.attention_output_norm, eps, kernels=kernels)
                x = add_norm(h, attention, layer.post_norm, eps, kernels=kernels)
                if layer.moe is not None:
                    mlp = moe_mlp(x, layer.moe, config, kernels=kernels)
                else:
                    assert layer.gate_up is not None and layer.down is not None
                    mlp = gated_mlp(x, layer.gate_up, layer.down, config.hidden_activation, kernels=kernels)
                delta = sublayer_output(self._summed(mlp), layer.mlp_output_norm, eps, kernels=kernels)
            if delta is not None:
                h += delta
        return self.logits_of(h[batch.logit_indices]), h

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `token_ids` (any shape), [*shape, hidden], in the stored dtype
        (float32 from blocks: only the looked-up rows are dequantized)."""
        if isinstance(self.embed, QuantizedWeight):
            return quantized.dequantize_rows(self.embed, token_ids)
        return F.embedding(token_ids, self.embed)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab] of residual-stream rows h [T, hidden]: final norm, LM head,
        and the final soft-cap cap * tanh(logits / cap) where the model has one (Gemma 2)."""
        normed = add_norm(h.contiguous(), None, self.norm, self.config.rms_norm_eps, kernels=self.native_kernels)
        logits = linear(normed, self.lm_head).contiguous().float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-split layer's output: this rank's partial sum, summed over the ranks (the one
        all-reduce of a sublayer); the output itself on one rank."""
        if self.all_reduce is None:
            return partial
        whole = partial.contiguous()
        self.all_reduce(whole)
        return whole

    def _layer_stack(self, kv_cache: KVCache) -> native_layers.LayerStack:
        """The kernel layers with this KV cache's pools, built once (and again for other pools)."""
        assert self.kernel_layers is not None
        if self._stack is None or not self._stack.serves(kv_cache.keys, kv_cache.values):
            self._stack = native_layers.LayerStack(tuple(self.kernel_layers), tuple(kv_cache.keys), tuple(kv_cache.values))
        return self._stack

    def _decoder_round(self, batch: ForwardBatch, calls: list[AttentionCall], kv_cache: KVCache) -> native_layers.DecoderRound:
        """What every `native_layers.decoder_layer` call of the round shares, checked once."""
        config = self.config
        qkv_channels = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        needed = batch.num_tokens * (
            2 * config.hidden_size + qkv_channels + 2 * config.num_heads * config.head_dim + 3 * config.intermediate_size
        )
        if self._layer_scratch.numel() < needed:
            self._layer_scratch = torch.empty(needed, dtype=torch.float32, device=self.device)
        return native_layers.decoder_round(
            positions=batch.positions,
            slots=batch.slot_mapping,
            cos=self.rope_cos,
            sin=self.rope_sin,
            groups=[(c.group.start, c.group.rows, c.group.query_len, c.group.block_table, c.group.start_positions) for c in calls],
            pool=kv_cache.keys[0],
            heads=config.num_heads,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            eps=config.rms_norm_eps,
            scratch=self._layer_scratch,
        )

ModelSplit = Callable[
    [ModelConfig, dict[str, "torch.Tensor | QuantizedWeight"]],
    tuple[ModelConfig, dict[str, "torch.Tensor | QuantizedWeight"], dict[str, Any]],
]
"""A tensor-parallel rank's view of a package (flare/parallel/tensor_split.py): its config,
its part of the weights, and DecoderModel's tensor-parallel arguments."""


def load_model(
    package: Package,
    device: torch.device | str = "cpu",
    weight_format: str = precision.AUTO,
    split: ModelSplit | None = None,
    activations: str = quantized.DEFAULT_ACTIVATIONS,
) -> DecoderModel:
    """The model of a prepared package on `device`: float32, with the linear layers in
    `weight_format` (`auto`: the fastest this device runs for the stored dtype,
    `precision.choose_weight_format`, which raises `WeightFormatError` for a format that does
    not run here). `split`: a tensor-parallel rank's part of it instead of the whole.
    `activations`: what its ggml block weights multiply (`quantized.ACTIVATIONS`: 8-bit
    activation blocks with integer dot products, or float32, exact)."""
    device = torch.device(device)
    stored = TORCH_DTYPES[package.manifest.serving.dtype]
    # One process's whole model moves its block matrices into huge pages (`blocks.in_huge_pages`);
    # a tensor-parallel rank keeps the mapping, of which it reads only its part.
    floats, blocks = package.load_weights(huge_pages=split is None and native.available())
    # Stored float16 fits by construction; other weights are scanned only where float16 may run.
    float16_may_run = weight_format == WeightFormat.FLOAT16 or (weight_format == precision.AUTO and stored != torch.float32)
    fits = stored == torch.float16 or not float16_may_run or all(fits_float16(t) for t in floats.values())
    chosen = precision.choose_weight_format(stored, device, weight_format, weights_fit_float16=fits)
    state_dict: dict[str, torch.Tensor | QuantizedWeight] = dict(floats)
    for name, tensor in blocks.items():
        # The package's types are the kernels' (`map_blocks` refuses others). Without the C
        # kernels each call would expand a whole matrix again: its values are expanded once here.
        if native.available():
            # Stacked experts [E, out, in] are their E * out rows: each expert a view of them (`layers/moe.py`).
            state_dict[name] = QuantizedWeight.from_blocks(
                tensor.ggml_type, tensor.data, tensor.data.shape[0], tensor.shape[-1], activations
            )
        else:
            state_dict[name] = dequantized(tensor)
    config, extra = package.manifest.model, {}
    if split is not None:
        config, state_dict, extra = split(config, state_dict)
    return DecoderModel(
        config, state_dict, device=device, weight_format=chosen, context=package.manifest.serving.max_context, **extra
    )
