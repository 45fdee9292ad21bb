"""The draft head as a trainable torch module: the same math as its paged runtime
(`engine/drafters/mtp.py`, a one-layer `DecoderModel`), over whole sequences at once.

Slot p of step 1 reads (h_{p-1}, x_p), with h the frozen target's residual stream after its
last layer (zeros before position 0), and predicts x_{p+1}. Step j > 1 is the head unrolled on
its own output: slot p reads (g_{j-1, p-1}, x_p), where g_{j-1} is step j - 1's output hidden
state, and attends to step 1's keys up to slot p - j + 1 and to step i's key at slot p - j + i
for 2 <= i <= j. That is exactly what the runtime's j-th draft step sees after a round whose last
committed slot is p - j + 1 (its own earlier drafts, then everything the catch-up wrote), with
the true token x_p in place of the draft (teacher forcing on tokens, not on hidden states).

The decoder layer is a Llama layer (`layer` "llama", what distillation trains) or the target's
own kind (`layer` "target", a DeepSeek checkpoint's MTP layer, `draft_head.head_block_config`):
latent attention in its decompressed form (every step's per-head keys and values through kv_b,
the rope key shared by the heads) and the target's MoE MLP, by the engine's routing
(`engine/layers/moe.py`). Such a head is imported, never trained: its experts are read without
gradients, and the module serves to measure its acceptance.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flare.engine.layers.moe import load_moe_weights, moe_mlp
from flare.engine.layers.rope import apply_rope, rope_tables
from flare.engine.precision import WeightFormat
from flare.package.draft_head import LAYER_PREFIX, VOCAB_TENSOR, draft_head_shapes, head_block_config
from flare.package.model_config import ModelConfig


class DraftHeadModule(nn.Module):
    """Trainable head weights; the target's embedding, final norm and LM head rows are frozen
    buffers, shared with the target and never saved with the head."""

    def __init__(
        self,
        config: ModelConfig,
        draft_vocab: torch.Tensor,
        embed: torch.Tensor,
        lm_head_rows: torch.Tensor,
        final_norm: torch.Tensor,
        *,
        seed: int,
        target_norm: torch.Tensor | None = None,
        layer: str = "llama",
    ) -> None:
        """`final_norm`: the norm before the LM head rows; `target_norm`: for a head that reads
        the target's hidden state after its final norm, that norm (None: the residual stream);
        `layer`: its decoder layer's kind (`DraftHeadInfo.layer`)."""
        super().__init__()
        self.config = config
        self.layer = layer
        self.block_config = head_block_config(config, layer, int(draft_vocab.numel()))
        generator = torch.Generator().manual_seed(seed)
        shapes = draft_head_shapes(config, int(draft_vocab.numel()), layer=layer)
        self.names = [name for name in shapes if name != VOCAB_TENSOR]
        self.weights = nn.ParameterList()
        for name in self.names:
            shape = shapes[name]
            if name.endswith("norm.weight"):
                value = torch.ones(shape)
            else:
                value = torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    value = value * 0.5  # a small first update of the residual stream
            self.weights.append(nn.Parameter(value))
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long))
        self.register_buffer("embed", embed)
        self.register_buffer("lm_head_rows", lm_head_rows.float())
        self.register_buffer("final_norm", final_norm.float())
        self.target_norm = None if target_norm is None else target_norm.float()
        cos, sin = rope_tables(config, torch.float32, "cpu")
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def w(self, name: str) -> torch.Tensor:
        return self.weights[self.names.index(name)]

    def state_for_package(self) -> dict[str, torch.Tensor]:
        """The tensors of `draft_head.safetensors`."""
        state = {name: p.detach().clone() for name, p in zip(self.names, self.weights)}
        state[VOCAB_TENSOR] = self.draft_vocab.clone()
        return state

    def load_package_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in zip(self.names, self.weights):
                p.copy_(state[name].float())

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (self.config.hidden_size,), weight, self.config.rms_norm_eps)

    def inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        embedded = F.embedding(tokens, self.embed).float()
        x = torch.cat((self._norm(hidden, self.w("mtp.hidden_norm.weight")), self._norm(embedded, self.w("mtp.embed_norm.weight"))), -1)
        return F.linear(x, self.w("mtp.fc.weight"))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(g, self.final_norm), self.lm_head_rows)

    def unrolled(self, hidden: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Output hidden states g_j [B, T, H] of steps 1..`steps` for sequences of tokens [B, T]
        and the target's residual stream hidden [B, T, H] at the same positions."""
        c = self.config
        batch, length = tokens.shape
        if self.target_norm is not None:
            hidden = self._norm(hidden, self.target_norm)
        prev = torch.cat((hidden.new_zeros(batch, 1, c.hidden_size), hidden[:, :-1]), 1)  # h_{p-1}
        cos, sin = self.cos[:length].unsqueeze(1), self.sin[:length].unsqueeze(1)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        slots = torch.arange(length, device=tokens.device)
        for step in range(1, steps + 1):
            x = self.inputs(prev, tokens)
            a = self._norm(x, self.w("mtp.layer.input_layernorm.weight"))
            q, k, v, scale = self._attention_inputs(a, cos, sin)
            keys.append(k)
            values.append(v)
            # Step 1 keys up to slot p - step + 1; step i's key at slot p - step + i.
            query = slots.view(-1, 1)
            blocks = [slots.view(1, -1) <= query - step + 1]
            blocks += [slots.view(1, -1) == query - step + i for i in range(2, step + 1)]
            mask = torch.cat(blocks, 1)  # [T, step * T]
            k_all = torch.cat(keys, 1).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
            v_all = torch.cat(values, 1).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), attn_mask=mask, scale=scale
            ).transpose(1, 2).reshape(batch, length, -1)
            h = x + F.linear(attn, self.w("mtp.layer.self_attn.o_proj.weight"))
            m = self._norm(h, self.w("mtp.layer.post_attention_layernorm.weight"))
            g = h + self._mlp(m)
            outputs.append(g)
            prev = torch.cat((g.new_zeros(batch, 1, c.hidden_size), g[:, :-1]), 1)
        return outputs

    def _attention_inputs(
        self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]:
        """One step's queries [B, T, H, D], keys [B, T, KV, D], values [B, T, KV, Dv] of the
        normed inputs `a`, RoPE applied, and the softmax scale (None: 1 / sqrt(D))."""
        c = self.config
        batch, length = a.shape[:2]
        latent = c.latent_attention
        if self.layer == "llama" or latent is None:
            q = F.linear(a, self.w("mtp.layer.self_attn.q_proj.weight")).view(batch, length, c.num_heads, c.head_dim)
            k = F.linear(a, self.w("mtp.layer.self_attn.k_proj.weight")).view(batch, length, c.num_kv_heads, c.head_dim)
            v = F.linear(a, self.w("mtp.layer.self_attn.v_proj.weight")).view(batch, length, c.num_kv_heads, c.head_dim)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, None
        # Latent attention (`engine/layers/latent_attention.py`), decompressed: the latent through
        # kv_a's norm and kv_b gives each head's nope key and value; the rope key is shared.
        heads, n, r, rank = c.num_heads, latent.qk_nope_head_dim, latent.qk_rope_head_dim, latent.kv_lora_rank
        p = f"{LAYER_PREFIX}.self_attn."
        if latent.q_lora_rank is None:
            q = F.linear(a, self.w(p + "q_proj.weight"))
        else:
            q_a = F.linear(a, self.w(p + "q_a_proj.weight"))
            q = F.linear(self._norm_of(q_a, self.w(p + "q_a_layernorm.weight")), self.w(p + "q_b_proj.weight"))
        q_nope, q_rope = q.view(batch, length, heads, n + r).split([n, r], dim=-1)
        kv = F.linear(a, self.w(p + "kv_a_proj_with_mqa.weight"))
        latent_rows = self._norm_of(kv[..., :rank], self.w(p + "kv_a_layernorm.weight"))
        k_rope = apply_rope(kv[..., None, rank:], cos, sin).expand(batch, length, heads, r)
        k_nope, v = F.linear(latent_rows, self.w(p + "kv_b_proj.weight")).view(batch, length, heads, -1).split(
            [n, latent.v_head_dim], dim=-1
        )
        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        return q, k, v, c.attention_scale or (n + r) ** -0.5

    def _mlp(self, m: torch.Tensor) -> torch.Tensor:
        """The layer's MLP of the normed rows m [B, T, H]: the gated MLP, or the target's experts."""
        if self.block_config.is_moe_layer(0):
            prefix = f"{LAYER_PREFIX}.mlp"
            state = {name: self.w(name).detach() for name in self.names if name.startswith(prefix + ".")}
            weights = load_moe_weights(self.block_config, state, prefix, WeightFormat.FLOAT32, m.device)
            rows = m.reshape(-1, m.shape[-1])
            return moe_mlp(rows, weights, self.block_config, kernels=False).view_as(m)
        gate = F.linear(m, self.w("mtp.layer.mlp.gate_proj.weight"))
        up = F.linear(m, self.w("mtp.layer.mlp.up_proj.weight"))
        return F.linear(F.silu(gate) * up, self.w("mtp.layer.mlp.down_proj.weight"))

    def _norm_of(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.config.rms_norm_eps)
