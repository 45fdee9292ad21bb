"""Draft heads for tests on the tiny model, and the reference drafts a head should propose.

`repeat_head_state` builds a head that proposes the sequence's last token again (its block is
the identity, its projection passes the token's embedding through, and the tied LM head scores a
token's own embedding highest), which the peaked tiny model often accepts; `mix` adds random
block weights, so the drafts also depend on the head's KV of the context.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from flare.distill.head_model import DraftHeadModule
from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.model import DecoderModel
from flare.package.draft_head import DraftHeadInfo, HeldOutAcceptance, head_parameter_count
from flare.package.model_config import ModelConfig


def head_module(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    draft_vocab: torch.Tensor,
    seed: int = 0,
    *,
    final_norm: torch.Tensor | None = None,
    reads_final_norm: bool = False,
) -> DraftHeadModule:
    """The dense head over the tiny target `state`; `final_norm`: the head's own (default the
    target's); `reads_final_norm`: it reads the target's hidden state after its final norm."""
    embed = state["model.embed_tokens.weight"].float()
    norm = state["model.norm.weight"].float()
    return DraftHeadModule(
        config,
        draft_vocab,
        embed,
        embed[draft_vocab].contiguous(),
        norm if final_norm is None else final_norm,
        seed=seed,
        target_norm=norm if reads_final_norm else None,
    )


def repeat_head_state(
    config: ModelConfig, target_state: dict[str, torch.Tensor], draft_vocab: torch.Tensor, *, mix: float = 0.0, seed: int = 0
) -> dict[str, torch.Tensor]:
    module = head_module(config, target_state, draft_vocab, seed=seed)
    state = module.state_for_package()
    h = config.hidden_size
    fc = torch.zeros(h, 2 * h)
    fc[:, h:] = torch.eye(h) * 3.0
    state["mtp.fc.weight"] = fc + mix * state["mtp.fc.weight"]
    for name in ("mtp.layer.self_attn.o_proj.weight", "mtp.layer.mlp.down_proj.weight"):
        state[name] = mix * state[name]
    return state


def head_info(config: ModelConfig, draft_vocab_size: int, draft_tokens: int, dtype: str = "float32") -> DraftHeadInfo:
    return DraftHeadInfo(
        draft_tokens=draft_tokens,
        draft_vocab_size=draft_vocab_size,
        parameters=head_parameter_count(config, draft_vocab_size),
        dtype=dtype,
        prompt_set="tests",
        budget={"tokens": 0, "seconds": 0, "seed": 0},
        trained={},
        held_out=HeldOutAcceptance(per_step=(0.5,) * draft_tokens, tokens_per_round=1.0 + 0.5 * draft_tokens, positions=1),
    )


def write_head_package(
    make_package: Callable[..., Path],
    package_parts: dict[str, Any],
    head_state: dict[str, torch.Tensor],
    *,
    draft_tokens: int = 3,
    state_dict: dict[str, torch.Tensor] | None = None,
    **changes: Any,
) -> Path:
    """`changes`: ServingConfig fields (vocabulary_parallel_sampling) or write_package arguments (policy)."""
    config = package_parts["config"]
    vocab = int(head_state["mtp.draft_vocab"].numel())
    serving_changes = {k: changes.pop(k) for k in list(changes) if k == "vocabulary_parallel_sampling"}
    return make_package(
        state_dict=state_dict if state_dict is not None else package_parts["state_dict"],
        serving=replace(package_parts["serving"], drafter="mtp", draft_tokens=draft_tokens, **serving_changes),
        draft_head=(head_info(config, vocab, draft_tokens), head_state),
        **changes,
    )


@torch.no_grad()
def reference_drafts(
    config: ModelConfig,
    target_state: dict[str, torch.Tensor],
    head_state: dict[str, torch.Tensor],
    tokens: list[int],
    steps: int,
) -> list[int]:
    """The greedy drafts the head proposes after `tokens` (the last one sampled, not yet fed to the
    target), computed from scratch: the target over tokens[:-1], then the unrolled head."""
    target = DecoderModel(config, target_state)
    n = len(tokens)
    blocks = -(-(n + steps) // 16)
    kv = KVCache(num_layers=config.num_layers, num_blocks=blocks, block_size=16, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    batch = ForwardBatch.build([ForwardRow(tokens[:-1], 0, tuple(range(blocks)), 1)], 16)
    _, hidden = target.forward_hidden(batch, kv)
    module = head_module(config, target_state, head_state["mtp.draft_vocab"])
    module.load_package_state(head_state)
    drafts: list[int] = []
    for _ in range(steps):
        sequence = torch.tensor(tokens + drafts).unsqueeze(0)
        padded = torch.cat((hidden, hidden.new_zeros(sequence.shape[1] - hidden.shape[0], hidden.shape[1]))).unsqueeze(0)
        outputs = module.unrolled(padded, sequence, len(drafts) + 1)
        g = outputs[len(drafts)][0, n - 1 + len(drafts)]
        drafts.append(int(module.draft_vocab[module.logits(g).argmax()]))
    return drafts
