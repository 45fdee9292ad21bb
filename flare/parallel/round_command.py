"""What rank 0 sends the workers each round, and how: the wire form of a round's plan.

A worker needs what its shard of the round computes on: the forward rows (new tokens, their
positions, block tables and how many logits each returns), the block copies to make first (the
allocator and the prefix cache stay on rank 0; every rank's KV pool copies the same blocks),
and the sampling inputs (drafts, the batch's parameters, the grammar's bitmask, logprobs). It
travels as one tensor_codec buffer over the gloo control group: a broadcast of its length,
then of the buffer (benchmarks/parallel_plan_broadcast.py measured this against a
shared-memory ring; docs/architecture.md has the figures). A length of 0 is the stop command.
The daemon sends a `RoundCommand` (the forward) and then, as its sampler reaches them, the
`ShardStep`s over that forward's logits: sampling, echo scoring, and the few whole rows that
filters and the INVALID_SPECULATION fallback need.
The bitmask goes whole to every rank (ceil(V / 32) words per position) and each rank cuts its
own slice (vocab_shard.local_token_mask). A learned drafter's q is not sent: across ranks the
n-gram drafter runs (one-hot q), see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from flare.engine.batch import ForwardRow
from flare.sampler.batch import BatchFacts, SamplingBatch
from flare.parallel.tensor_codec import decode, encode

_BATCH_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "first_position", "prompt_ids", "output_ids", "bias_ids", "bias_values",
)  # fmt: skip
_FACT_FIELDS = (
    "any_greedy", "any_sampled", "any_penalized", "any_filtered", "max_top_k", "any_top_p",
    "any_temperature_scaling", "any_biased",
)  # fmt: skip


@dataclass(frozen=True)
class RoundSampling:
    """The sampling inputs of a round, the same on every rank (`sample_round` with `ShardsAcrossRanks`).
    ``draft_probs`` is q whole, [R, Kmax, V] (each rank takes its columns); the daemon sends it
    only for a test's INVALID_DRAFT_PROBABILITY fault, since learned drafters do not run across
    ranks."""

    num_drafts: torch.Tensor
    draft_tokens: torch.Tensor
    batch: SamplingBatch
    token_mask: torch.Tensor | None = None
    num_logprobs: int | None = None
    raw_logprobs: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class RoundCommand:
    index: int
    rows: tuple[ForwardRow, ...]
    copies: tuple[tuple[int, int], ...]
    sampling: RoundSampling | None
    """None for a round that only fills the cache (prompt chunks that sample nothing)."""

    def encode(self) -> torch.Tensor:
        rows = self.rows
        head = [self.index, len(rows), len(self.copies), int(self.sampling is not None)]
        row_table = torch.tensor(
            [[r.start_position, len(r.token_ids), len(r.block_table), r.num_logits] for r in rows], dtype=torch.int64
        ).reshape(len(rows), 4)
        tokens = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64)
        blocks = torch.tensor([b for r in rows for b in r.block_table], dtype=torch.int64)
        copies = torch.tensor(self.copies, dtype=torch.int64).reshape(len(self.copies), 2)
        tensors: list[torch.Tensor | None] = [torch.tensor(head), row_table, tokens, blocks, copies]
        if self.sampling is not None:
            tensors += _sampling_tensors(self.sampling)
        return encode(tensors)

    @classmethod
    def decode(cls, buffer: torch.Tensor) -> RoundCommand:
        tensors = decode(buffer)
        head, row_table, tokens, blocks, copies = tensors[:5]
        assert head is not None and row_table is not None and tokens is not None and blocks is not None
        assert copies is not None
        index, _, _, has_sampling = head.tolist()
        rows, token_at, block_at = [], 0, 0
        for start, num_tokens, num_blocks, num_logits in row_table.tolist():
            rows.append(
                ForwardRow(
                    token_ids=tuple(tokens[token_at : token_at + num_tokens].tolist()),
                    start_position=start,
                    block_table=tuple(blocks[block_at : block_at + num_blocks].tolist()),
                    num_logits=num_logits,
                )
            )
            token_at += num_tokens
            block_at += num_blocks
        sampling = _sampling_of(tensors[5:]) if has_sampling else None
        return cls(index=index, rows=tuple(rows), copies=tuple(tuple(c) for c in copies.tolist()), sampling=sampling)


class StepKind(IntEnum):
    """What a worker does with its shard of the round's logits (rank 0 does the same with its own)."""

    SAMPLE = 1
    """`sample_round` across ranks over ``positions`` with ``sampling``."""
    SCORE = 2
    """`score_tokens` across ranks of ``targets`` at ``positions`` (echo)."""
    GATHER = 3
    """`gather_rows` of ``positions``: whole rows to rank 0, for rows with filters (the
    single-shard sampler's) and the INVALID_SPECULATION fallback."""


@dataclass(frozen=True)
class ShardStep:
    """One collective step over the last forward's logits, after a `RoundCommand`: rank 0 sends
    it, then every rank runs it on the rows ``positions`` of its vocabulary shard."""

    kind: StepKind
    positions: torch.Tensor
    sampling: RoundSampling | None = None
    targets: torch.Tensor | None = None
    num_top: int = 0

    def encode(self) -> torch.Tensor:
        head = torch.tensor([int(self.kind), self.num_top, int(self.sampling is not None)])
        tensors: list[torch.Tensor | None] = [head, self.positions, self.targets]
        if self.sampling is not None:
            tensors += _sampling_tensors(self.sampling)
        return encode(tensors)

    @classmethod
    def decode(cls, buffer: torch.Tensor) -> ShardStep:
        tensors = decode(buffer)
        head, positions, targets = tensors[:3]
        assert head is not None and positions is not None
        kind, num_top, has_sampling = head.tolist()
        sampling = _sampling_of(tensors[3:]) if has_sampling else None
        return cls(StepKind(kind), positions, sampling, targets, num_top)


def _sampling_tensors(sampling: RoundSampling) -> list[torch.Tensor | None]:
    batch = sampling.batch
    facts = torch.tensor([int(getattr(batch.facts, name)) for name in _FACT_FIELDS], dtype=torch.int64)
    logprobs = torch.tensor([-1 if sampling.num_logprobs is None else sampling.num_logprobs])
    tensors = [sampling.num_drafts, sampling.draft_tokens, sampling.token_mask, logprobs, sampling.raw_logprobs, facts]
    return [*tensors, sampling.draft_probs, *(getattr(batch, name) for name in _BATCH_FIELDS)]


def _sampling_of(tensors: list[torch.Tensor | None]) -> RoundSampling:
    num_drafts, draft_tokens, token_mask, logprobs, raw_logprobs, facts, draft_probs = tensors[:7]
    assert num_drafts is not None and draft_tokens is not None and logprobs is not None and facts is not None
    fields = dict(zip(_BATCH_FIELDS, tensors[7:], strict=True))
    flags = facts.tolist()
    batch_facts = BatchFacts(
        **{name: (value if name == "max_top_k" else bool(value)) for name, value in zip(_FACT_FIELDS, flags, strict=True)}
    )
    return RoundSampling(
        num_drafts=num_drafts,
        draft_tokens=draft_tokens,
        batch=SamplingBatch(facts=batch_facts, **fields),
        token_mask=token_mask,
        num_logprobs=None if int(logprobs[0]) < 0 else int(logprobs[0]),
        raw_logprobs=raw_logprobs,
        draft_probs=draft_probs,
    )


Message = RoundCommand | ShardStep
_KINDS = (RoundCommand, ShardStep)

WAIT_FOR_WORK = timedelta(days=365)
"""How long a worker waits for rank 0's next message: without a deadline (gloo has no unbounded
timeout; a year stands for one), since an idle daemon sends nothing. Liveness is checked apart
from the work (launch.py); the rest of a round keeps the group's collective timeout."""


STOP_TIMEOUT = timedelta(seconds=10)
"""How long rank 0's stop command waits for the workers to take it. A gloo send completes only
once its receiver has posted the receive (a worker that reads the stop 2 s late holds rank 0's
send 2 s), so a stop that returns has been read, and rank 0 may leave the groups at once; a
worker that is still not reading after this long (a frozen host) is not waited for."""


def send_command(command: Message | None, group: dist.ProcessGroup) -> None:
    """Rank 0: broadcast ``command`` (None: stop, waiting at most STOP_TIMEOUT) to the workers:
    its size and kind, then it."""
    buffer = command.encode() if command is not None else torch.zeros(0, dtype=torch.uint8)
    kind = _KINDS.index(type(command)) if command is not None else -1
    header = torch.tensor([buffer.numel(), kind], dtype=torch.int64)
    if command is None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = STOP_TIMEOUT
        group.broadcast([header], options).wait()
        return
    dist.broadcast(header, src=0, group=group)
    if buffer.numel():
        dist.broadcast(buffer, src=0, group=group)


def receive_message(group: dist.ProcessGroup) -> Message | None:
    """A worker: the next command or step from rank 0 (None: stop), waiting for it without a
    deadline."""
    size_and_kind = torch.zeros(2, dtype=torch.int64)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = WAIT_FOR_WORK
    group.broadcast([size_and_kind], options).wait()
    size, kind = size_and_kind.tolist()
    if size == 0:
        return None
    buffer = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    return _KINDS[kind].decode(buffer)


def receive_command(group: dist.ProcessGroup) -> RoundCommand | None:
    """A worker that runs only forwards: the next command from rank 0 (None: stop)."""
    message = receive_message(group)
    if isinstance(message, ShardStep):
        raise ValueError(f"expected a round command from rank 0, got a {message.kind.name} step")
    return message
