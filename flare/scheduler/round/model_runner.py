"""One round on the device: the batched target forward, then sampling and verification.

Runs in the scheduler's single worker thread. It receives an immutable `RoundPlan` and returns
an immutable `RoundResult`; sequences, blocks and streams stay on the event-loop thread.
The device is read back once per round: tokens, emitted counts and status codes together,
and with a draft head the next round's drafts too (a second read happens only in a round where
a row falls back after INVALID_SPECULATION).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable

import structlog
import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.drafters import Draft
from flare.engine.drafters.mtp import HeadDrafts, HeadRow, MtpHead
from flare.engine.kv_cache import KVCache
from flare.engine.model import DecoderModel
from flare.sampler import LocalShards, SamplingBatch, sample_round, score_tokens
from flare.sampler.faults import FaultNotInjectable, inject_fault
from flare.sampler.logprobs import TokenLogprobs
from flare.sampler.round import SampledRound
from flare.sampler.status import DeviceStatus
from flare.parallel.round_command import RoundSampling
from flare.parallel.serving import RankDriver, RankLogits
from flare.scheduler.request import TokenLogprob
from flare.scheduler.round.plan import PlannedRow, RoundPlan, Sampling
from flare.scheduler.round.result import RoundResult, RowResult
from flare.structured import fill_masks

log = structlog.get_logger("flare.scheduler.runner")


RoundObserver = Callable[[RoundPlan, ForwardBatch, torch.Tensor, torch.Tensor], None]


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        *,
        vocab_size: int,
        vocabulary_shards: int,
        fallback_on_invalid_speculation: bool,
        device: torch.device,
        head: MtpHead | None = None,
        observer: RoundObserver | None = None,
        ranks: RankDriver | None = None,
    ) -> None:
        """`observer(plan, batch, hidden, logits)` sees every round's target outputs on the
        device, in the model thread (distillation records the target's features with it).
        `ranks`: a tensor-parallel group (`model` is rank 0's shard): every rank runs the
        forward and keeps its vocabulary shard of the logits; sampling and scoring run on every
        shard and merge on rank 0 (`RankLogits`)."""
        self.model = model
        self.kv_cache = kv_cache
        self.head = head
        self.observer = observer
        self.vocab_size = vocab_size
        self.vocabulary_shards = vocabulary_shards
        self.fallback_on_invalid_speculation = fallback_on_invalid_speculation
        self.device = device
        self.ranks = ranks

    def rank_list(self) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """This host's tensor-parallel ranks as (rank, pid, CPUs); empty without a group."""
        return () if self.ranks is None else tuple((r.rank, r.pid, r.cpus) for r in self.ranks.group.ranks)

    def check_group(self) -> None:
        """Raise EngineDead once the tensor-parallel group has lost a rank (its watcher noticed
        a worker exit), even between rounds; nothing without a group."""
        if self.ranks is not None:
            self.ranks.group.failstop.check()

    def close(self) -> None:
        """Stop the group's other ranks, if any."""
        if self.ranks is not None:
            self.ranks.close()

    def execute(self, plan: RoundPlan) -> RoundResult:
        started = time.perf_counter()
        with torch.inference_mode():
            self.kv_cache.copy_blocks(plan.copies)
            if self.head is not None:
                self.head.copy_blocks(plan.copies)
            forward_rows = [
                # An out-of-vocabulary draft must reach the verify kernel (status
                # INVALID_DRAFT_TOKEN), not crash the embedding lookup of the whole round.
                ForwardRow(self._embeddable(row.token_ids), row.start_position, row.block_table, row.num_logits)
                for row in plan.rows
            ]
            batch = ForwardBatch.build(forward_rows, self.kv_cache.block_size, self.device)
            hidden = None
            logits: torch.Tensor | RankLogits
            if self.ranks is not None:
                # A draft head runs on rank 0 alone, from its whole residual stream.
                logits, hidden = self.ranks.forward(
                    self.model, self.kv_cache, forward_rows, plan.copies, hidden=self.head is not None
                )
            elif self.head is None and self.observer is None:
                logits = self.model.forward(batch, self.kv_cache)
            else:
                logits, hidden = self.model.forward_hidden(batch, self.kv_cache)
            if self.head is not None:
                self.head.write_hidden(batch.slot_mapping, hidden)
            if self.observer is not None:
                self.observer(plan, batch, hidden, logits)
            scoring = [k for k, row in enumerate(plan.rows) if row.scoring is not None]
            sampling = [row for row in plan.rows if row.samples]
            scores = self._score_prompts([plan.rows[k] for k in scoring], logits, plan.rows) if scoring else None
            if scoring and sampling:
                logits = logits[self._sampling_positions(plan.rows)]
            head_seconds = 0.0

            def drafts(tokens: torch.Tensor, emitted: torch.Tensor, order: list[int]) -> HeadDrafts | None:
                nonlocal head_seconds
                head_started = time.perf_counter()
                try:
                    return self._draft(sampling, tokens, emitted, order)
                finally:
                    head_seconds = time.perf_counter() - head_started

            sampled = iter(self._sample(sampling, logits, drafts) if sampling else [])
            results: list[RowResult | None] = [next(sampled) if row.samples else None for row in plan.rows]
            if scores is not None:
                # Read after the round's read: the device has finished by then.
                for k, entries in zip(scoring, _scored_entries([plan.rows[k] for k in scoring], scores)):
                    results[k] = dataclasses.replace(
                        results[k] or RowResult((), DeviceStatus.OK), prompt_logprobs=entries
                    )
        return RoundResult(tuple(results), time.perf_counter() - started, head_seconds)

    def _sampling_positions(self, rows: tuple[PlannedRow, ...]) -> torch.Tensor:
        """The flat logit rows that sampling reads: the last 1 + drafts of each sampling row."""
        index: list[int] = []
        for row, offset in zip(rows, _logit_offsets(list(rows))):
            end = offset + row.num_logits
            index.extend(range(end - row.sample_positions, end))
        return torch.tensor(index, device=self.device)

    def _score_prompts(
        self, scoring: list[PlannedRow], logits: torch.Tensor | RankLogits, rows: tuple[PlannedRow, ...]
    ) -> TokenLogprobs:
        """Log-probabilities of the prompt tokens that scoring rows' first positions predict."""
        offsets = dict(zip((id(row) for row in rows), _logit_offsets(list(rows))))
        index = [offsets[id(row)] + i for row in scoring for i in range(len(row.scoring.targets))]
        targets = [t for row in scoring for t in row.scoring.targets]
        device = logits.device
        at = logits[torch.tensor(index, device=device)]
        target_ids = torch.tensor(targets, dtype=torch.int64, device=device)
        num_top = max(row.scoring.top for row in scoring)
        if isinstance(at, RankLogits):
            assert self.ranks is not None
            return self.ranks.score(at, target_ids, num_top)
        return score_tokens(at, target_ids, num_top, LocalShards(self.vocabulary_shards))


    def _draft(
        self, rows: list[PlannedRow], tokens: torch.Tensor, emitted: torch.Tensor, order: list[int]
    ) -> HeadDrafts | None:
        """The draft head's pass over the sampling rows that draft (`drafters/mtp.py`), before
        the host read. `order`: the row of `tokens` each sampling row's results are in."""
        if self.head is None:
            return None
        position = {k: i for i, k in enumerate(order)}  # sampling row -> row of `tokens`
        head_rows = [
            HeadRow(
                first_slot=head.first_slot,
                block_table=row.block_table,
                host_tokens=head.tokens,
                device_tokens=1 + len(row.draft_ids),
                sample_index=position[k],
                steps=head.steps,
                temperature=sampling.params.temperature,
                top_k=sampling.params.top_k,
                top_p=sampling.params.top_p,
                min_p=sampling.params.min_p,
                seed=sampling.seed,
                output_position=sampling.output_position,
            )
            for k, (row, sampling) in enumerate(zip(rows, _samplings(rows)))
            if (head := row.draft_head) is not None
        ]
        return self.head.run(head_rows, tokens, emitted)

    def _sample(
        self,
        rows: list[PlannedRow],
        logits: torch.Tensor | RankLogits,
        before_read: Callable[[torch.Tensor, torch.Tensor, list[int]], HeadDrafts | None] | None = None,
    ) -> list[RowResult]:
        """Sample every row (logits holds exactly their positions, in order) with one host read.

        `before_read(tokens, emitted, order)` runs on the device results first (the draft head),
        and its drafts are read back in the same read."""
        offsets = _sample_offsets(rows)
        samplings = _samplings(rows)
        masks = self._masks(rows, offsets, logits.shape[0])
        # A fault of INVALID_SPECULATION needs the sharded sampler; everything else follows the
        # package's sampler unless the row fell back. Across ranks, rows without a filter join
        # the sharded group too (the same tokens), so that only rows with one are gathered whole.
        parallel = [
            s.vocabulary_parallel
            or s.fault == DeviceStatus.INVALID_SPECULATION
            or (self.ranks is not None and not (s.params.temperature > 0 and s.params.filtered))
            for s in samplings
        ]
        groups = [[k for k in range(len(rows)) if parallel[k] == p] for p in (False, True)]
        groups = [g for g in groups if g]
        width = 1 + max(len(row.draft_ids) for row in rows)
        outputs = []
        for group in groups:
            group_rows = [rows[k] for k in group]
            group_masks = masks
            if len(groups) == 1:
                group_logits = logits
            else:
                index = [i for k in group for i in range(offsets[k], offsets[k] + rows[k].sample_positions)]
                group_logits = logits[torch.tensor(index, device=logits.device)]
                group_masks = masks[torch.tensor(index, device=masks.device)] if masks is not None else None
            shards = 1
            if parallel[group[0]]:
                injected = any(samplings[k].fault == DeviceStatus.INVALID_SPECULATION for k in group)
                shards = max(2, self.vocabulary_shards) if injected else self.vocabulary_shards
            outputs.append(self._sample_rows(group_rows, group_logits, shards, width, group_masks))
        order = [k for group in groups for k in group]
        tokens, emitted, status = (torch.cat([getattr(out, name) for out in outputs]) for name in ("tokens", "num_emitted", "status"))
        head = before_read(tokens, emitted, order) if before_read is not None else None
        # The one device-to-host read of the round.
        read = _read_back(tokens, emitted, status, outputs, [rows[k] for k in order])
        results: list[RowResult] = [RowResult((), DeviceStatus.OK)] * len(rows)
        for result, k in zip(read, order):
            results[k] = result
        if head is not None:
            assert self.head is not None
            host_drafts = head.tokens.tolist()
            drafting = (k for k, row in enumerate(rows) if row.draft_head is not None)
            for d, k in enumerate(drafting):
                steps = rows[k].head_steps
                greedy = samplings[k].params.temperature <= 0
                q, vocab = (None, None) if greedy else (head.probs[d, :steps], self.head.draft_vocab)
                results[k] = dataclasses.replace(results[k], next_draft=Draft(tuple(host_drafts[d][:steps]), q, vocab))

        if self.fallback_on_invalid_speculation:
            retry = [k for k, r in enumerate(results) if r.status == DeviceStatus.INVALID_SPECULATION]
            if retry:
                fallen = self._fall_back([rows[k] for k in retry], [offsets[k] for k in retry], logits, masks)
                for k, result in zip(retry, fallen):
                    results[k] = result
        return results

    def _masks(self, rows: list[PlannedRow], offsets: list[int], num_positions: int) -> torch.Tensor | None:
        """The round's token masks, [positions, ceil(V / 32)] int32 (every token allowed on rows
        without a grammar), or None when no row has one."""
        constrained = [
            (s.grammar, offsets[k], row.draft_ids)
            for k, (row, s) in enumerate(zip(rows, _samplings(rows)))
            if s.grammar is not None
        ]
        if not constrained:
            return None
        masks = torch.full((num_positions, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        fill_masks(constrained, masks)
        return masks.to(self.device)

    def _fall_back(
        self, rows: list[PlannedRow], offsets: list[int], logits: torch.Tensor | RankLogits, masks: torch.Tensor | None
    ) -> list[RowResult]:
        """Resample rows that got INVALID_SPECULATION without drafts, with the standard sampler
        (which supports filters), from the logits at each row's first position: the prediction
        after the last accepted token, which the rejected drafts never influenced."""
        plain = [
            dataclasses.replace(
                row,
                sampling=dataclasses.replace(sampling, vocabulary_parallel=False, fault=None),
                drafts=None,
                draft_head=None,
            )
            for row, sampling in zip(rows, _samplings(rows))
        ]
        index = torch.tensor(offsets, device=logits.device)
        out = self._sample_rows(plain, logits[index], 1, 1, masks[index] if masks is not None else None)
        read = _read_back(out.tokens, out.num_emitted, out.status, [out], plain)
        return [dataclasses.replace(result, fell_back=True) for result in read]

    def _sample_rows(
        self, rows: list[PlannedRow], logits: torch.Tensor | RankLogits, shards: int, width: int, masks: torch.Tensor | None
    ) -> SampledRound:
        device = logits.device
        k_max = max(width - 1, 1)
        draft_tokens = torch.tensor(
            [list(row.draft_ids) + [-1] * (k_max - len(row.draft_ids)) for row in rows], dtype=torch.long
        ).to(device)
        draft_probs = None
        drafts = [row.drafts for row in rows]
        if any(d is not None and d.probs is not None for d in drafts):
            # Learned drafters' q next to one-hot q written out for the deterministic rows.
            draft_probs = torch.zeros(len(rows), k_max, self.vocab_size)
            for r, (row, d) in enumerate(zip(rows, drafts)):
                if d is not None and d.probs is not None and d.vocab is not None:
                    draft_probs[r, : len(row.draft_ids)].index_copy_(1, d.vocab.cpu(), d.probs.cpu())
                elif d is not None and d.probs is not None:
                    draft_probs[r, : len(row.draft_ids)] = d.probs
                else:
                    for j, token in enumerate(row.draft_ids):
                        if 0 <= token < self.vocab_size:
                            draft_probs[r, j, token] = 1.0
            draft_probs = draft_probs.to(device)
        samplings = _samplings(rows)
        batch = SamplingBatch.from_rows(
            [s.params for s in samplings],
            seeds=[s.seed for s in samplings],
            positions=[s.output_position for s in samplings],
            prompt_ids=[s.prompt_ids for s in samplings],
            output_ids=[s.output_ids for s in samplings],
            device=device,
        )
        offsets = _sample_offsets(rows)
        for r, (row, s) in enumerate(zip(rows, samplings)):
            if s.fault is not None:
                try:
                    faulted = inject_fault(
                        s.fault,
                        row=r,
                        first_logit_row=offsets[r],
                        row_num_drafts=len(row.draft_ids),
                        logits=logits,
                        draft_tokens=draft_tokens,
                        draft_probs=draft_probs,
                        batch=batch,
                        vocab_shards=shards,
                    )
                except FaultNotInjectable as error:
                    # A test fault this row cannot have this round (a draft status on the row's
                    # first round, which samples after the prompt and has no drafts): the row runs
                    # as it is, rather than the exception failing every row of the round.
                    log.warning(
                        "fault_not_injected", request_id=row.request_id, status=s.fault.name, reason=str(error)
                    )
                    continue
                logits, draft_tokens, draft_probs, batch = (
                    faulted.logits,
                    faulted.draft_tokens,
                    faulted.draft_probs,
                    faulted.batch,
                )
        wanted = [s.logprobs for s in samplings if s.logprobs is not None]
        num_drafts = torch.tensor([len(row.draft_ids) for row in rows], dtype=torch.long, device=device)
        num_logprobs = max(wanted) if wanted else None
        raw_logprobs = (
            torch.tensor([s.raw_logprobs for s in samplings], device=device) if any(s.raw_logprobs for s in samplings) else None
        )
        if isinstance(logits, RankLogits):
            assert self.ranks is not None
            if not (shards == 1 and batch.facts.any_filtered):
                sampling = RoundSampling(num_drafts, draft_tokens, batch, masks, num_logprobs, raw_logprobs, draft_probs)
                return self.ranks.sample(logits, sampling)
            # Filters need the whole distribution (the merge of per-shard statistics does not
            # filter): these rows' positions are gathered for the single-shard sampler.
            logits = self.ranks.whole(logits)
        return sample_round(
            logits,
            num_drafts=num_drafts,
            draft_tokens=draft_tokens,
            draft_probs=draft_probs,
            batch=batch,
            shards=LocalShards(shards),
            token_mask=masks,
            num_logprobs=num_logprobs,
            raw_logprobs=raw_logprobs,
        )

    def _embeddable(self, token_ids: tuple[int, ...]) -> tuple[int, ...]:
        v = self.vocab_size
        return token_ids if all(0 <= t < v for t in token_ids) else tuple(t if 0 <= t < v else 0 for t in token_ids)


def _read_back(
    tokens: torch.Tensor, emitted: torch.Tensor, status: torch.Tensor, outputs: list[SampledRound], rows: list[PlannedRow]
) -> list[RowResult]:
    """The rows' results from the kernels' outputs (one per group, rows in order, their tokens,
    counts and statuses already concatenated), with the log-probabilities of the emitted tokens
    where asked."""
    host_tokens, host_emitted, host_status = tokens.tolist(), emitted.tolist(), status.tolist()
    # Per row (logprob, top ids, top logprobs) of its group's output; groups may ask for
    # different numbers of alternatives (or none), so they are read group by group.
    row_logprobs: list[tuple[list[float], list[list[int]], list[list[float]]] | None] = []
    for out in outputs:
        if out.logprobs is None:
            row_logprobs += [None] * out.tokens.shape[0]
            continue
        logprob, top_ids, top_logprobs = (
            getattr(out.logprobs, name).tolist() for name in ("logprob", "top_ids", "top_logprobs")
        )
        row_logprobs += list(zip(logprob, top_ids, top_logprobs, strict=True))
    results = []
    for r, sampling in enumerate(_samplings(rows)):
        n = host_emitted[r]
        entries: tuple[TokenLogprob, ...] = ()
        if (wanted := sampling.logprobs) is not None and (asked := row_logprobs[r]) is not None:
            entries = tuple(_entry(host_tokens[r][j], asked[0][j], asked[1][j], asked[2][j], wanted) for j in range(n))
        results.append(RowResult(tuple(host_tokens[r][:n]), DeviceStatus(host_status[r]), logprobs=entries))
    return results


def _scored_entries(rows: list[PlannedRow], scores: TokenLogprobs) -> list[tuple[TokenLogprob, ...]]:
    logprob, top_ids, top_logprobs = scores.logprob.tolist(), scores.top_ids.tolist(), scores.top_logprobs.tolist()
    entries, start = [], 0
    for row in rows:
        assert row.scoring is not None
        end = start + len(row.scoring.targets)
        entries.append(
            tuple(
                _entry(t, logprob[i], top_ids[i], top_logprobs[i], row.scoring.top)
                for t, i in zip(row.scoring.targets, range(start, end))
            )
        )
        start = end
    return entries


def _entry(token: int, logprob: float, top_ids: list[int], top_logprobs: list[float], k: int) -> TokenLogprob:
    """One token's entry; alternatives of probability 0 (masked or filtered out) are left out."""
    top = tuple((i, v) for i, v in zip(top_ids[:k], top_logprobs[:k]) if i >= 0 and v != float("-inf"))
    return TokenLogprob(token, logprob, top)


def _samplings(rows: list[PlannedRow]) -> list[Sampling]:
    """The sampling parts of rows that all sample."""
    samplings = []
    for row in rows:
        assert row.sampling is not None, "only rows that sample reach the sampler"
        samplings.append(row.sampling)
    return samplings


def _logit_offsets(rows: list[PlannedRow]) -> list[int]:
    """Where each row's logits start in the forward's output."""
    return _starts(row.num_logits for row in rows)


def _sample_offsets(rows: list[PlannedRow]) -> list[int]:
    """Where each sampling row's positions start in the logits sampling reads."""
    return _starts(row.sample_positions for row in rows)


def _starts(sizes: Iterable[int]) -> list[int]:
    """The start of each of consecutive runs of `sizes` items."""
    return [0, *itertools.accumulate(sizes)][:-1]
