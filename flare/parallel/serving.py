"""A tensor-parallel group behind the scheduler: rank 0's `RankDriver` and the workers' loop.

Each round rank 0 broadcasts the round's forward rows and block copies (round_command.py),
every rank copies the blocks in its pool and runs the forward over its heads, and each keeps
its vocabulary shard of the logits. The forward returns a `RankLogits` to rank 0's sampler:
rank 0's shard, the positions it holds, and the steps over every rank's shard. As the sampler
reaches a step (sampling, echo scoring, whole rows), rank 0 broadcasts it (`ShardStep`) and
every rank runs the sampler's conductor (sampler/round.py) on its slice with the across-ranks
reduction (vocab_round.py): rank 0 gathers per-shard statistics and decides. Only rows with filters (top-k, top-p, min-p), which the
merge does not filter, and the INVALID_SPECULATION fallback's rows are gathered whole.

Any collective error or a round past its deadline is the group's failure (failstop.py): the
driver raises `EngineDead`, the scheduler ends every request with `engine_dead` and stops, and
the daemon exits non-zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.model import DecoderModel, load_model
from flare.engine.quantized import QuantizedWeight, served_activations
from flare.sampler.logprobs import TokenLogprobs
from flare.sampler.round import SampledRound, sample_round, score_tokens
from flare.parallel.group import ProcessGroups, all_reduce_sum
from flare.parallel.launch import RankGroup, WorkerSpec
from flare.parallel.layout import ParallelLayout
from flare.parallel.round_command import RoundCommand, RoundSampling, ShardStep, StepKind, receive_message, send_command
from flare.parallel.tensor_split import rank_config, rank_state_dict, vocabulary_rows
from flare.parallel.vocab_round import ShardsAcrossRanks, gather_rows
from flare.parallel.vocab_shard import VocabShard
from flare.package.model_config import ModelConfig
from flare.package.directory import open_package

log = structlog.get_logger("flare.parallel")
_T = TypeVar("_T")

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The KV pool dtypes, by the code rank 0 broadcasts."""
STARTUP_TIMEOUT = timedelta(seconds=600)
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
ROUND_DEADLINE_S = 120.0
"""A round longer than this on any rank fails the group (a prompt chunk of the default model
takes well under a second; a rank stuck this long is lost)."""


def split_for(rank: int, tensor_parallel: int, all_reduce: Callable[[torch.Tensor], None] | None = None):
    """`load_model`'s `split` for one rank: its config, its weights, and the all-reduce (the
    group's sum, `all_reduce_sum`, unless given) and LM head rows of its model."""

    def split(config: ModelConfig, state_dict: dict[str, torch.Tensor | QuantizedWeight]):
        extra: dict[str, Any] = {
            "all_reduce": all_reduce or all_reduce_sum,
            "lm_head_rows": vocabulary_rows(config, rank, tensor_parallel),
        }
        return rank_config(config, tensor_parallel), rank_state_dict(config, state_dict, rank, tensor_parallel), extra

    return split


def rank_cache(config: ModelConfig, tensor_parallel: int, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVCache:
    """A rank's KV pool: its KV heads, the same block ids as rank 0's allocator hands out."""
    local = rank_config(config, tensor_parallel)
    return KVCache.for_config(local, num_blocks, block_size, dtype)


def _load_worker(path: str, weight_format: str, activations: str, rank: int, world_size: int) -> tuple[DecoderModel, ModelConfig]:
    package = open_package(Path(path))
    activations = served_activations(package.weight_types(), activations)
    model = load_model(package, weight_format=weight_format, split=split_for(rank, world_size), activations=activations)
    return model, package.manifest.model


def _serve_worker(groups: ProcessGroups, state: tuple[DecoderModel, ModelConfig]) -> None:
    """A worker: its KV pool sized as rank 0 says (the first broadcast: blocks, block size, dtype
    code), then one round per command until the stop command."""
    model, config = state
    pool = torch.zeros(3, dtype=torch.int64)
    dist.broadcast(pool, src=0, group=groups.control)
    num_blocks, block_size, dtype_code = pool.tolist()
    cache = rank_cache(config, groups.world_size, num_blocks, block_size, KV_DTYPES[dtype_code])
    shard = VocabShard.of(model.config.vocab_size, groups.device)
    logits = torch.zeros(0, shard.width)
    while (message := receive_message(groups.control)) is not None:
        if isinstance(message, RoundCommand):
            logits, _ = _forward(model, cache, message.rows, message.copies)
        else:
            with torch.inference_mode():
                run_step(shard, logits[message.positions], message)


@torch.inference_mode()
def _forward(
    model: DecoderModel,
    cache: KVCache,
    rows: Sequence[ForwardRow],
    copies: Sequence[tuple[int, int]],
    *,
    hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's [positions, width] shard of the round's logits, and where asked the residual
    stream after the last layer [tokens, hidden]: whole on every rank, since each layer ends in
    an all-reduce (what a draft head on rank 0 reads). Both run the same collectives."""
    cache.copy_blocks(list(copies))
    batch = ForwardBatch.build(list(rows), cache.block_size)
    if hidden:
        return model.forward_hidden(batch, cache)
    return model.forward(batch, cache), None


def run_step(shard: VocabShard, logits: torch.Tensor, step: ShardStep) -> SampledRound | TokenLogprobs | torch.Tensor | None:
    """``step`` on this rank's ``logits`` (its shard at the step's positions); rank 0 gets the
    result, the others None."""
    if step.kind == StepKind.SAMPLE:
        s = step.sampling
        assert s is not None
        draft_probs = s.draft_probs[..., shard.start : shard.end] if s.draft_probs is not None else None
        return sample_round(
            logits,
            s.num_drafts,
            s.draft_tokens,
            draft_probs,
            s.batch,
            ShardsAcrossRanks(shard),
            token_mask=s.token_mask,
            num_logprobs=s.num_logprobs,
            raw_logprobs=s.raw_logprobs,
        )
    if step.kind == StepKind.SCORE:
        assert step.targets is not None
        return score_tokens(logits, step.targets, step.num_top, ShardsAcrossRanks(shard))
    return gather_rows(shard, logits, torch.arange(logits.shape[0]))


def worker_spec(package_path: str, weight_format: str, activations: str) -> WorkerSpec:
    """What every worker rank runs: its shard of the package (its blocks multiplying what rank 0's
    do, `served_activations`), then the round loop."""
    return WorkerSpec(functools.partial(_load_worker, package_path, weight_format, activations), _serve_worker)


def serve_headless(
    package_path: str,
    layout: ParallelLayout,
    weight_format: str,
    activations: str,
    bind: str | None = None,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT.total_seconds(),
) -> int:
    """A host other than rank 0's (`flare run --node-rank K`, K > 0): start this host's ranks,
    meet rank 0, and wait; the exit status is non-zero once a rank stops (its peer was lost),
    for the supervisor to restart it."""
    group = RankGroup(
        layout,
        worker_spec(package_path, weight_format, activations),
        torch.device("cpu"),
        STARTUP_TIMEOUT,
        timedelta(seconds=collective_timeout_s),
        bind,
    )
    group.connect()
    log.info("tensor_parallel_host", node_rank=layout.node_rank, ranks=[(r.rank, r.pid, list(r.cpus)) for r in group.ranks])
    return group.wait()


class RankDriver:
    """Rank 0's side: starts the workers (they load while rank 0 does), then runs each round's
    forward on every rank, and the sampler's steps over the ranks' shards of its logits."""

    def __init__(
        self,
        package_path: str,
        layout: ParallelLayout,
        *,
        weight_format: str,
        activations: str,
        startup_timeout: timedelta = STARTUP_TIMEOUT,
        collective_timeout: timedelta = COLLECTIVE_TIMEOUT,
        bind: str | None = None,
    ) -> None:
        """``bind``: this host's ranks' CPU lists ("0-15|16-31", threads.py); rank 0's list then
        pins the calling thread, the scheduler's model thread that loads and runs rank 0's
        rounds (and the OpenMP threads it starts), not the event loop. None: the workers take
        even runs of the CPUs and rank 0 is left as it is."""
        self.group = RankGroup(
            layout, worker_spec(package_path, weight_format, activations), torch.device("cpu"), startup_timeout,
            collective_timeout, bind,
        )
        if bind:
            self.group.pin_own()
        self.tensor_parallel = layout.tensor_parallel
        self._shard: VocabShard | None = None
        self._rounds = 0

    def connect(self, vocab_size: int, cache: KVCache) -> None:
        """After rank 0's own shard has loaded: wait for this host's workers, meet every rank,
        and size their KV pools as ``cache`` (its block count, block size and dtype)."""
        groups = self.group.connect()
        assert groups is not None
        pool = torch.tensor([cache.num_blocks, cache.block_size, KV_DTYPES.index(cache.dtype)], dtype=torch.int64)
        dist.broadcast(pool, src=0, group=groups.control)
        self._shard = VocabShard.of(vocab_size, groups.device)
        log.info("tensor_parallel_group", ranks=[(r.rank, r.pid, list(r.cpus)) for r in self.group.ranks])

    def forward(
        self,
        model: DecoderModel,
        cache: KVCache,
        rows: Sequence[ForwardRow],
        copies: Sequence[tuple[int, int]],
        *,
        hidden: bool = False,
    ) -> tuple[RankLogits, torch.Tensor | None]:
        """Every rank's forward of ``rows``; the [positions, V] logits as a `RankLogits`, and
        with ``hidden`` rank 0's residual stream after the last layer (`_forward`). The other
        ranks first make the block ``copies`` that rank 0 (the runner) has already made in its
        pool."""
        assert self._shard is not None
        command = RoundCommand(self._rounds, tuple(rows), tuple(copies), None)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            send_command(command, self._control)
            return _forward(model, cache, rows, (), hidden=hidden)

        local, stream = self._collective(run)
        self._rounds += 1
        return RankLogits(local, torch.arange(local.shape[0]), self._shard.vocab_size, self), stream

    def sample(self, logits: RankLogits, sampling: RoundSampling) -> SampledRound:
        """`sample_round` of ``logits``' rows from the ranks' per-shard statistics."""
        result = self._step(logits, ShardStep(StepKind.SAMPLE, logits.positions, sampling=sampling))
        assert isinstance(result, SampledRound)
        return result

    def score(self, logits: RankLogits, targets: torch.Tensor, num_top: int) -> TokenLogprobs:
        """`score_tokens` of ``targets`` at ``logits``' rows (echo)."""
        result = self._step(logits, ShardStep(StepKind.SCORE, logits.positions, targets=targets, num_top=num_top))
        assert isinstance(result, TokenLogprobs)
        return result

    def whole(self, logits: RankLogits) -> torch.Tensor:
        """``logits``' rows whole, [rows, V]: every rank's slice gathered to rank 0."""
        result = self._step(logits, ShardStep(StepKind.GATHER, logits.positions))
        assert isinstance(result, torch.Tensor)
        return result

    def _step(self, logits: RankLogits, step: ShardStep) -> SampledRound | TokenLogprobs | torch.Tensor | None:
        shard = self._shard
        assert shard is not None

        def run() -> SampledRound | TokenLogprobs | torch.Tensor | None:
            send_command(step, self._control)
            return run_step(shard, logits.local, step)

        return self._collective(run)

    @property
    def _control(self) -> dist.ProcessGroup:
        assert self.group.groups is not None
        return self.group.groups.control

    def _collective(self, work: Callable[[], _T]) -> _T:
        """``work`` under the round's deadline; any collective failure is the group's."""
        failstop = self.group.failstop
        failstop.check()
        try:
            with failstop.deadline(ROUND_DEADLINE_S):
                result = work()
        except RuntimeError as error:
            raise failstop.collective_failed(error) from error
        failstop.check()
        return result

    def close(self) -> None:
        """Stop the workers (orderly: the stop command, then their pipes close)."""
        groups = self.group.groups
        if groups is not None and self.group.failstop.reason is None:
            try:
                send_command(None, groups.control)
            except RuntimeError:
                pass
        self.group.stop()



@dataclass(frozen=True)
class RankLogits:
    """Rank 0's handle on a round's logits across the ranks: its own shard of the rows it
    stands for (``local``, [rows, width]) and where those rows are in the forward's output
    (``positions``, what a step tells the workers). Indexing selects rows, as on a tensor, with
    no communication; ``shape`` is the whole logits' [rows, V]."""

    local: torch.Tensor
    positions: torch.Tensor
    vocab_size: int
    driver: RankDriver

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.positions.numel(), self.vocab_size))

    @property
    def device(self) -> torch.device:
        return self.local.device

    def __getitem__(self, rows: torch.Tensor) -> RankLogits:
        return RankLogits(self.local[rows], self.positions[rows.to(self.positions.device)], self.vocab_size, self.driver)

    def __setitem__(self, key: tuple[int, int], value: float) -> None:
        """Write into rank 0's shard (its columns are tokens 0.. of the vocabulary: a test's
        NONFINITE_LOGITS fault writes token 0 of a row)."""
        self.local[key] = value
