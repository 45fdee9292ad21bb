"""A tiny DeepSeek-V3 checkpoint with its multi-token-prediction layer, built by transformers, and
the reference computation of that layer (transformers has no MTP forward).

`write_mtp_checkpoint` builds DeepSeek-V3 (tests/family_checkpoints.py's deepseek_v3_moe: latent
attention, sigmoid group routing with a random correction bias, a shared expert) with one layer
more than its config declares: transformers' own `DeepseekV3DecoderLayer` at index
num_hidden_layers is the MTP layer's decoder layer, MoE as the model's last layer is (or dense
with `moe=False`: the target is dense throughout). Beside it the layer gets DeepSeek's `enorm`,
`hnorm`, `eh_proj`, `shared_head.norm` and copies of the LM head and embedding
(`shared_head.head`, `embed_tokens`), and config.json declares `num_nextn_predict_layers: 1`.

Peaked so that drafts are accepted: the LM head is the embedding times LOGIT_SCALE and the target's
layers write little into the residual stream (their o_proj and down projections scaled by
`TARGET_MIX`), so the target mostly repeats the token it reads; the MTP layer's `eh_proj` passes
the embedding of its token through beside a random projection of the hidden state, and its
decoder layer's writes are scaled by `mix`, so it mostly proposes that token again while its
attention, experts and router still move its logits.

`reference_head` is DeepSeek's MTP module (DeepSeek-V3 report, section 2.2) on flare's slots: slot p
reads the target's hidden state after its final norm at p - 1 (zeros at slot 0) and token x_p,
h' = layer(eh_proj([enorm(emb(x_p)); hnorm(h)])), its logits lm_head(shared_head.norm(h')); a
further draft step reads its own h' at the slot before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.family_checkpoints import family_config, write_checkpoint

LOGIT_SCALE = 0.6
PASS_THROUGH = 1.0
TARGET_MIX = 0.2


@dataclass(frozen=True)
class MtpCheckpoint:
    path: Path
    model: Any  # transformers' DeepseekV3ForCausalLM whose config runs the target's layers; layers[-1] is the MTP layer's
    mtp: dict[str, torch.Tensor]  # the MTP layer's own tensors: enorm, hnorm, eh_proj, shared_head.norm

    @property
    def layer_index(self) -> int:
        return self.model.config.num_hidden_layers


def write_mtp_checkpoint(
    path: Path,
    tokenizer_json: str,
    chat_template: str,
    *,
    moe: bool = True,
    family: str = "deepseek_v3_moe",
    mix: float = 0.3,
    logit_scale: float = LOGIT_SCALE,
    seed: int = 0,
) -> MtpCheckpoint:
    """The checkpoint at `path` (module docstring); `family`: tests/family_checkpoints.py's
    deepseek_v3_moe or deepseek_v2_moe (V2's q_proj and group-limited softmax routing);
    `logit_scale`: the LM head's factor over the embedding (lower: the target's next-token
    distribution is flatter)."""
    config = family_config(family)
    layers = config.num_hidden_layers
    changes: dict[str, Any] = {"num_hidden_layers": layers + 1}
    if not moe:
        changes["first_k_dense_replace"] = layers + 1  # every layer dense, the MTP layer's too
    checkpoint = write_checkpoint(family, path, tokenizer_json, chat_template, seed=seed, changes=changes)
    model = checkpoint.model
    g = torch.Generator().manual_seed(seed + 1)
    h = config.hidden_size
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * logit_scale)
        for index, layer in enumerate(model.model.layers):
            scale = TARGET_MIX if index < layers else mix
            for name, parameter in layer.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                    parameter.mul_(scale)
    model.save_pretrained(path)
    eh = torch.zeros(h, 2 * h)
    eh[:, :h] = torch.eye(h) * PASS_THROUGH  # [enorm(embedding); hnorm(hidden)]: the embedding comes first
    eh[:, h:] = torch.randn(h, h, generator=g) / h**0.5
    mtp = {
        "enorm.weight": 1.0 + 0.2 * torch.randn(h, generator=g),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(h, generator=g),
        "eh_proj.weight": eh,
        "shared_head.norm.weight": 1.0 + 0.2 * torch.randn(h, generator=g),
    }
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) == 1, shards
    tensors = load_file(str(shards[0]))
    prefix = f"model.layers.{layers}."
    tensors.update({prefix + name: t for name, t in mtp.items()})
    tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(shards[0]), metadata={"format": "pt"})
    data = json.loads((path / "config.json").read_text())
    data.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(data))
    model.config.num_hidden_layers = layers  # its forward runs the target's layers only
    return MtpCheckpoint(path, model, mtp)


def _causal(length: int) -> torch.Tensor:
    return torch.full((length, length), float("-inf")).triu(1)[None, None]


@torch.no_grad()
def target_hidden(checkpoint: MtpCheckpoint, tokens: list[int]) -> torch.Tensor:
    """The target's hidden states after its final norm [T, hidden] (transformers' forward)."""
    ids = torch.tensor([tokens])
    return checkpoint.model.model(input_ids=ids).last_hidden_state[0].float()


@torch.no_grad()
def reference_head(checkpoint: MtpCheckpoint, hidden: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP module over slots 0 .. S-1: slot p reads hidden[p] (what it reads of position p - 1:
    zeros, the target's normed hidden state, or the head's own output) and tokens[p]. Its outputs
    h' [S, hidden] and logits [S, vocab]."""
    model, mtp = checkpoint.model, checkpoint.mtp
    layer = model.model.layers[checkpoint.layer_index]
    eps = model.config.rms_norm_eps
    h = model.config.hidden_size
    embedded = model.model.embed_tokens(torch.tensor(tokens)).float()
    x = torch.cat(
        (F.rms_norm(embedded, (h,), mtp["enorm.weight"], eps), F.rms_norm(hidden.float(), (h,), mtp["hnorm.weight"], eps)), -1
    )
    x = F.linear(x, mtp["eh_proj.weight"]).unsqueeze(0)
    positions = torch.arange(len(tokens)).unsqueeze(0)
    rope = model.model.rotary_emb(x, positions)
    out = layer(x, attention_mask=_causal(len(tokens)), position_ids=positions, position_embeddings=rope)[0]
    logits = F.linear(F.rms_norm(out, (h,), mtp["shared_head.norm.weight"], eps), model.lm_head.weight)
    return out, logits


def reference_drafts(checkpoint: MtpCheckpoint, tokens: list[int], steps: int, temperature: float, drafted: list[int]) -> list[torch.Tensor]:
    """q = softmax(logits / T) of each of `steps` draft steps after `tokens` (the target has
    computed every position but the last, whose token it sampled), step j + 1 fed draft
    `drafted[j]` and the head's own output of step j."""
    hidden = torch.cat((torch.zeros(1, checkpoint.model.config.hidden_size), target_hidden(checkpoint, tokens[:-1])))
    sequence = list(tokens)
    qs = []
    for j in range(steps):
        out, logits = reference_head(checkpoint, hidden, sequence)
        qs.append(torch.softmax(logits[-1] / temperature, -1))
        hidden = torch.cat((hidden, out[-1:]))
        sequence.append(drafted[j])
    return qs
