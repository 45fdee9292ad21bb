"""A package's learned draft head (`preparation/draft_head.py`) running inside the round.

Head slot p reads (h_{p-1}, x_p): the target's hidden state at the position before and the token
at p (slot 0 reads a zero hidden state and x_0); slot p depends only on tokens x_0 .. x_p. Every
round the target's hidden states of all the round's positions go into the head's hidden pool
(one vector per KV slot, the target cache's block ids), and the head works only for the rows
that draft, batched over them:

1. Catch-up: the row's head slots from the first it has not computed (`HeadRow.first_slot`,
   which the scheduler tracks) to the slot of its new token, reading the hidden states from the
   pool. The tokens are the row's own where the host knows them, and the round's sampled tokens
   for the rest: the slots after the row's last host token take emitted token i, so the slot of
   the last accepted token's successor holds the bonus or correction token, and slots past it
   hold garbage that is written again before any query reads it (causal attention reads only
   earlier slots, and every later catch-up starts at the first slot not committed). A row that
   does not draft this round computes nothing: when it drafts again it catches up on every slot
   since, from the pool, in one pass. A prefix-cache hit starts at slot 0 for the same reason:
   the pool holds the cached positions' hidden states, whoever computed them.
2. Drafting: the head's output at the slot of the new token (found on the device from the
   emitted count) predicts the first draft; K - 1 more steps feed the head's own output back as
   the hidden state, one batched single-token row per drafting row each.

The head's KV pool has one layer and the target's block ids: rollback after rejected drafts is
the target's (positions past the accepted length are written again later), copy-on-write copies
the pools. Drafts are sampled under the row's temperature from q = softmax(logits / T) over the
draft vocabulary (zero elsewhere), with a random stream keyed by the row's seed and the drafted
token's output position (`Purpose.DRAFT`), so a seeded request's drafts, and with them its
output, do not depend on its batch-mates; greedy rows draft the argmax with a one-hot q.
The request's top-k, top-p and min-p filters are applied to q as well, by the target's own
kept-set rule (`kernels/distribution.py`: one threshold on the scaled logits): rejection
sampling is exact for any q, and a q without the tail the target's filters remove is accepted
more often (a draft the filtered target gives probability 0 is always rejected). Penalties are not applied
to q (they depend on the row's output counts, which only the sampling kernels keep).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flare.engine.batch import AttentionGroup, ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.linear import linear, pack_weight
from flare.engine.model import DecoderModel
from flare.sampler.distribution import kept_threshold
from flare.sampler.random_stream import Purpose, stream_key, vocabulary_gumbel
from flare.package.draft_head import FINAL_NORM_TENSOR, LAYER_PREFIX, VOCAB_TENSOR, head_block_config
from flare.package.model_config import ModelConfig
from flare.package.directory import Package


@dataclass(frozen=True)
class HeadRow:
    """What the head needs of one drafting row of the round (host facts only).

    The row computes head slots `first_slot` .. `first_slot + num_slots - 1`: slot p reads the
    pooled hidden state of position p - 1 (a zero state for slot 0) and token x_p, which is
    `host_tokens[p - first_slot]` for the first len(host_tokens) slots and sampled token
    p - first_slot - len(host_tokens) of round row `sample_index` for the last `device_tokens`
    (1 + the row's drafts). Then it drafts `steps` tokens after its new token.
    """

    first_slot: int
    block_table: tuple[int, ...]
    host_tokens: tuple[int, ...]
    device_tokens: int
    sample_index: int
    steps: int
    temperature: float = 0.0
    top_k: int = -1  # the request's filters, applied to q too (module docstring)
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    output_position: int = 0  # output index of the row's first sampled token

    @property
    def num_slots(self) -> int:
        return len(self.host_tokens) + self.device_tokens


@dataclass(frozen=True)
class HeadDrafts:
    """The next round's drafts of the drafting rows (in the order of their `HeadRow`s),
    on the device: token ids [D, K] and q over the draft vocabulary [D, K, V'] (rows of greedy
    requests carry a one-hot q, which the host replaces by None), K the most steps of any row: a
    row's columns past its own steps are not drafts."""

    tokens: torch.Tensor
    probs: torch.Tensor


class MtpHead:
    """The draft head's weights, its one-layer KV pool, the pool of the target's hidden states
    it reads, and the drafting passes of a round."""

    def __init__(
        self,
        config: ModelConfig,
        head_state: Mapping[str, torch.Tensor],
        target: DecoderModel,
        lm_head_rows: torch.Tensor,
        final_norm: torch.Tensor,
        *,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
        target_norm: torch.Tensor | None = None,
        layer: str = "llama",
    ) -> None:
        """`lm_head_rows` [V', hidden]: the target's LM head rows of the draft vocabulary (a
        gathered copy: the restricted GEMM needs them contiguous); `final_norm`: the norm before
        them (the target's, or the head's own). `target_norm`: for a head that reads the target's
        hidden state after its final norm (`DraftHeadInfo.target_hidden`), that norm's weight;
        `layer`: the kind of its decoder layer (`DraftHeadInfo.layer`).
        The head's KV cache and hidden pool have the target cache's blocks, in `kv_dtype` (the
        target cache's)."""
        device = target.device
        self.target = target
        self.draft_vocab = head_state[VOCAB_TENSOR].to(device, torch.long)
        self.vocab_size = int(self.draft_vocab.numel())
        # The block is a one-layer model whose tied "embedding" is the restricted LM head: its
        # forward gives the residual stream and `logits_of` the draft logits. Its layer is Llama's
        # whatever the target's family (`draft_head_shapes`, as distillation trains it), or the
        # target's own kind (`layer` "target": a DeepSeek MTP layer's latent attention, with a
        # latent KV pool of its own, and its experts), with the target's RoPE.
        block_config = head_block_config(config, layer, self.vocab_size)
        layer_state = {name.replace(f"{LAYER_PREFIX}.", "model.layers.0."): t for name, t in head_state.items() if name.startswith(f"{LAYER_PREFIX}.")}
        # The head's GEMMs run in the target's weight format, which was chosen as this CPU's
        # fastest: its LM head in float32 would cost more than the drafts save.
        self.block = DecoderModel(
            block_config,
            {**layer_state, "model.embed_tokens.weight": lm_head_rows, "model.norm.weight": final_norm},
            device=device,
            weight_format=target.weight_format,
            native_kernels=target.native_kernels,
            context=target.context,
        )
        self.fc = pack_weight(head_state["mtp.fc.weight"].to(device, torch.float32), target.weight_format)
        self.hidden_norm = head_state["mtp.hidden_norm.weight"].to(device, torch.float32).contiguous()
        self.embed_norm = head_state["mtp.embed_norm.weight"].to(device, torch.float32).contiguous()
        self.target_norm = None if target_norm is None else target_norm.to(device, torch.float32).contiguous()
        self.eps = config.rms_norm_eps
        self.hidden_size = config.hidden_size
        self.kv_cache = KVCache.for_config(block_config, num_blocks, block_size, kv_dtype, device)
        self.hidden_pool = torch.zeros(num_blocks * block_size, config.hidden_size, dtype=kv_dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.block.device

    def write_hidden(self, slot_mapping: torch.Tensor, hidden: torch.Tensor) -> None:
        """The target's hidden states [T, hidden] of a round's positions, into their slots."""
        self.hidden_pool.index_copy_(0, slot_mapping, hidden.to(self.hidden_pool.dtype))

    def copy_blocks(self, copies: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> None:
        """Copy-on-write of whole blocks (src, dst), in the head's KV and hidden pools."""
        self.kv_cache.copy_blocks(copies)
        bs = self.kv_cache.block_size
        for src, dst in copies:
            self.hidden_pool[dst * bs : (dst + 1) * bs] = self.hidden_pool[src * bs : (src + 1) * bs]

    def inputs(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """fc([RMSNorm(h); RMSNorm(embed(x))]): the block's input rows [N, hidden]."""
        embedded = self.target.embed_rows(token_ids).float()
        x = torch.cat(
            (
                F.rms_norm(hidden.float(), (self.hidden_size,), self.hidden_norm, self.eps),
                F.rms_norm(embedded, (self.hidden_size,), self.embed_norm, self.eps),
            ),
            dim=-1,
        )
        return linear(x, self.fc).contiguous()

    def run(self, rows: list[HeadRow], sampled: torch.Tensor, emitted: torch.Tensor) -> HeadDrafts | None:
        """Catch up on the drafting rows and draft for them; None when there are none.

        sampled [Rs, W] and emitted [Rs]: the round's sampled tokens and emitted counts, on the
        device. The round's hidden states must be in the pool already (`write_hidden`).
        """
        if not rows:
            return None
        device = self.device
        bs = self.kv_cache.block_size
        batch = ForwardBatch.build(
            [ForwardRow(range(row.num_slots), row.first_slot, row.block_table, 0) for row in rows], bs, device
        )
        tokens = [0] * batch.num_tokens
        fill_at, fill_row, fill_col = [], [], []
        for row, start in zip(rows, batch.row_starts):
            host = len(row.host_tokens)
            tokens[start : start + host] = row.host_tokens
            fill_at.extend(range(start + host, start + row.num_slots))
            fill_row.extend([row.sample_index] * row.device_tokens)
            fill_col.extend(range(row.device_tokens))
        token_ids = torch.tensor(tokens, dtype=torch.long, device=device)
        picked = sampled[torch.tensor(fill_row, device=device), torch.tensor(fill_col, device=device)]
        # Past a row's emitted tokens the sampled tensor holds -1: garbage slots, any token will do.
        token_ids[torch.tensor(fill_at, device=device)] = picked.clamp(min=0)
        # Slot p reads the hidden state at position p - 1: within a row that is the pool slot of
        # the flat entry before; a row's first slot reads the slot before it (a zero state for 0).
        source = batch.slot_mapping.roll(1)
        source[torch.tensor(batch.row_starts, device=device)] = torch.tensor(
            [row.block_table[(row.first_slot - 1) // bs] * bs + (row.first_slot - 1) % bs if row.first_slot else -1 for row in rows],
            device=device,
        )
        hidden = torch.where((source >= 0).unsqueeze(1), self.hidden_pool[source.clamp(min=0)].float(), 0.0)
        if self.target_norm is not None:  # RMSNorm keeps slot 0's zero state zero
            hidden = F.rms_norm(hidden, (self.hidden_size,), self.target_norm, self.eps)
        _, out = self.block.forward_hidden(batch, self.kv_cache, self.inputs(hidden, token_ids))

        steps = max(row.steps for row in rows)
        sample_rows = torch.tensor([row.sample_index for row in rows], device=device)
        accepted = (emitted[sample_rows].to(torch.long) - 1).clamp(min=0)  # n: drafts accepted this round
        # The slot of the row's new token: the one after its last host slot, plus n.
        offsets = torch.tensor([start + len(row.host_tokens) for row, start in zip(rows, batch.row_starts)], device=device)
        slot0 = torch.tensor([row.first_slot + len(row.host_tokens) for row in rows], device=device) + accepted
        g = out[offsets + accepted]
        temperature = torch.tensor([row.temperature for row in rows], device=device)
        all_greedy = all(row.temperature <= 0 for row in rows)
        filters = DraftFilters.of(rows, device)
        keys = None  # [D, steps]: the stream of each row's draft at each step (output position)
        if not all_greedy:
            seeds = torch.tensor([row.seed for row in rows], dtype=torch.long, device=device)
            first_output = torch.tensor([row.output_position for row in rows], device=device) + accepted + 1
            keys = stream_key(
                seeds.unsqueeze(1), first_output.unsqueeze(1) + torch.arange(steps, device=device), Purpose.DRAFT
            )
        last_slot = max(row.first_slot + row.num_slots - 1 + row.steps for row in rows)
        width = -(-(last_slot + 1) // bs)
        block_table = torch.tensor(
            [list(row.block_table[:width]) + [0] * (width - min(width, len(row.block_table))) for row in rows],
            dtype=torch.long,
            device=device,
        )
        draft_tokens, draft_probs = [], []
        for step in range(steps):
            # Only rows that draft this many write a step's slot: the scheduler gave each row the
            # blocks of its own steps, and a slot past them would be another sequence's.
            active = [i for i, row in enumerate(rows) if row.steps > step]
            if step > 0 and len(active) == len(rows):
                g = self._step(g, draft_tokens[-1], slot0 + step, block_table, last_slot)
            elif step > 0:
                index = torch.tensor(active, device=device)
                g = g.index_copy(
                    0, index, self._step(g[index], draft_tokens[-1][index], slot0[index] + step, block_table[index], last_slot)
                )
            token, probs = self._sample(
                self.block.logits_of(g), temperature, filters, None if keys is None else keys[:, step]
            )
            draft_tokens.append(token)
            draft_probs.append(probs)
        return HeadDrafts(torch.stack(draft_tokens, 1), torch.stack(draft_probs, 1))

    def _step(
        self, g: torch.Tensor, token_ids: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor, max_slot: int
    ) -> torch.Tensor:
        """One draft step: each drafting row's single token at its slot (device positions)."""
        bs = self.kv_cache.block_size
        rows = g.shape[0]
        slot_mapping = block_table.gather(1, (slots // bs).unsqueeze(1)).squeeze(1) * bs + slots % bs
        group = AttentionGroup(start=0, rows=rows, query_len=1, block_table=block_table, start_positions=slots, block_size=bs)
        batch = ForwardBatch(
            token_ids=token_ids,
            positions=slots,
            slot_mapping=slot_mapping,
            logit_indices=torch.arange(0, device=g.device),
            groups=(group,),
            block_size=bs,
            max_position=max_slot,
            row_starts=tuple(range(rows)),
        )
        _, out = self.block.forward_hidden(batch, self.kv_cache, self.inputs(g, token_ids))
        return out

    def _sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        filters: DraftFilters | None,
        keys: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft token ids [D] and q [D, V'] under each row's temperature and filters, drawn with
        the streams `keys` [D] (one-hot q for greedy rows; None keys: every row is greedy, and q
        is empty)."""
        if keys is None:
            # q is one-hot for every row: the host replaces it by None, nothing to compute.
            choice = logits.argmax(-1)
            return self.draft_vocab[choice], logits.new_zeros(0)
        greedy = temperature <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        if filters is not None:
            # The target's kept-set rule (one threshold on the scaled logits, ties kept together),
            # by the same radix select as the target's filters, which costs less than a sort of
            # the draft vocabulary at every step.
            threshold, _ = kept_threshold(
                scaled, scaled.amax(-1), filters.top_k, filters.top_p, filters.log_min_p, filters.max_top_k, filters.any_top_p
            )
            probs = torch.where(scaled >= threshold.unsqueeze(1), probs, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        noise = vocabulary_gumbel(keys, self.vocab_size)
        # log(0) = -inf for filtered tokens, by a where: ATen's log of 0 takes a slow path.
        log_q = torch.where(probs > 0, torch.where(probs > 0, probs, 1.0).log_(), float("-inf"))
        choice = torch.where(greedy, logits.argmax(-1), (log_q + noise).argmax(-1))
        one_hot = F.one_hot(choice, self.vocab_size).to(probs.dtype)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
        return self.draft_vocab[choice], probs


@dataclass(frozen=True)
class DraftFilters:
    """The drafting rows' top-k, top-p and min-p, sanitised as the target's are for
    `distribution_statistics` (top_k 0, top_p 1 and log_min_p -inf are off), with the host facts
    that let the threshold skip work."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    log_min_p: torch.Tensor
    max_top_k: int
    any_top_p: bool

    @staticmethod
    def of(rows: list[HeadRow], device: torch.device) -> DraftFilters | None:
        """The rows' filters; None when no row filters."""
        if not any(row.top_k > 0 or row.top_p < 1.0 or row.min_p > 0.0 for row in rows):
            return None
        return DraftFilters(
            top_k=torch.tensor([max(row.top_k, 0) for row in rows], device=device),
            top_p=torch.tensor([row.top_p for row in rows], device=device),
            log_min_p=torch.tensor([math.log(row.min_p) if row.min_p > 0 else -math.inf for row in rows], device=device),
            max_top_k=max(max(row.top_k, 0) for row in rows),
            any_top_p=any(row.top_p < 1.0 for row in rows),
        )


def load_draft_head(
    package: Package, target: DecoderModel, *, num_blocks: int, block_size: int, kv_dtype: torch.dtype = torch.float32
) -> MtpHead:
    """The package's draft head next to its loaded target model."""
    head_state = package.load_draft_head()
    info = package.manifest.draft_head
    assert info is not None
    config = package.manifest.model
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    vocab = head_state[VOCAB_TENSOR].long()
    rows = package.load_tensor(head_name)[vocab].contiguous()
    target_norm = package.load_tensor("model.norm.weight")
    return MtpHead(
        config,
        head_state,
        target,
        rows,
        head_state[FINAL_NORM_TENSOR].float() if FINAL_NORM_TENSOR in head_state else target_norm,
        num_blocks=num_blocks,
        block_size=block_size,
        kv_dtype=kv_dtype,
        target_norm=target_norm if info.target_hidden == "final_norm" else None,
        layer=info.layer,
    )
