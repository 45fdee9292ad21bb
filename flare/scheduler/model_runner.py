"""One round on the device: the batched target forward, then sampling and verification.

Runs in the scheduler's single worker thread. It receives an immutable `RoundPlan` and returns
an immutable `RoundResult`; sequences, blocks and streams stay on the event-loop thread.
The device is read back once per round: tokens, emitted counts and status codes together
(a second read happens only in a round where a row falls back after INVALID_SPECULATION).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.model import LlamaModel
from flare.kernels import SamplingBatch, sample_round
from flare.kernels.status import DeviceStatus
from flare.sampling.params import SamplingParams


@dataclass(frozen=True)
class PlannedRow:
    """One row of a round: new tokens of one sequence, and how to sample after them.

    `token_ids` is the sequence's uncached tail (a prompt chunk, or its last sampled token)
    followed by `draft_ids`. The row samples when `samples` is set: it then needs logits at
    its last `1 + len(draft_ids)` positions, and the first sampled token has index
    `output_position` in the request's output (the key of its random stream).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    samples: bool
    draft_ids: tuple[int, ...]
    draft_probs: torch.Tensor | None  # [len(draft_ids), vocab] for learned drafters; None: one-hot q
    params: SamplingParams
    seed: int
    output_position: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    vocabulary_parallel: bool
    fault: DeviceStatus | None = None

    @property
    def num_logits(self) -> int:
        return 1 + len(self.draft_ids) if self.samples else 0


@dataclass(frozen=True)
class RoundPlan:
    index: int
    rows: tuple[PlannedRow, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)


@dataclass(frozen=True)
class RowResult:
    tokens: tuple[int, ...]  # accepted drafts then one sampled token; empty on failure
    status: DeviceStatus
    fell_back: bool = False


@dataclass(frozen=True)
class RoundResult:
    rows: tuple[RowResult | None, ...]  # aligned with plan.rows; None for rows that do not sample
    seconds: float


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        *,
        vocab_size: int,
        vocabulary_shards: int,
        fallback_on_invalid_speculation: bool,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.vocabulary_shards = vocabulary_shards
        self.fallback_on_invalid_speculation = fallback_on_invalid_speculation
        self.device = device

    def execute(self, plan: RoundPlan) -> RoundResult:
        started = time.perf_counter()
        with torch.inference_mode():
            rows = [self._with_fault(row) for row in plan.rows]
            batch = ForwardBatch.build(
                [
                    # An out-of-vocabulary draft must reach the verify kernel (status
                    # INVALID_DRAFT_TOKEN), not crash the embedding lookup of the whole round.
                    ForwardRow(self._embeddable(row.token_ids), row.start_position, row.block_table, row.num_logits)
                    for row in rows
                ],
                self.kv_cache.block_size,
                self.device,
            )
            logits = self.model.forward(batch, self.kv_cache)
            sampling = [i for i, row in enumerate(rows) if row.samples]
            results: list[RowResult | None] = [None] * len(rows)
            if sampling:
                self._inject_logit_faults(rows, sampling, logits)
                for i, result in zip(sampling, self._sample(rows, sampling, logits, plan.rows)):
                    results[i] = result
        return RoundResult(tuple(results), time.perf_counter() - started)

    def _sample(
        self,
        rows: list[PlannedRow],
        sampling: list[int],
        logits: torch.Tensor,
        original: tuple[PlannedRow, ...],
    ) -> list[RowResult]:
        # Rows sampled by the vocabulary-parallel sampler and by the standard one go through
        # separate kernel calls; the results are concatenated so the host reads them once.
        offsets = _logit_offsets([rows[i] for i in sampling])
        groups = [
            [k for k, i in enumerate(sampling) if rows[i].vocabulary_parallel == parallel] for parallel in (False, True)
        ]
        tokens, emitted, statuses = [], [], []
        order: list[int] = []
        width = 1 + max(len(rows[i].draft_ids) for i in sampling)
        for parallel, group in zip((False, True), groups):
            if not group:
                continue
            group_rows = [rows[sampling[k]] for k in group]
            group_logits = torch.cat([logits[offsets[k] : offsets[k] + rows[sampling[k]].num_logits] for k in group])
            shards = self.vocabulary_shards if parallel else 1
            if parallel and any(row.fault == DeviceStatus.INVALID_SPECULATION for row in group_rows):
                shards = max(2, shards)  # the fault needs a truly sharded sampler
            out = self._sample_rows(group_rows, group_logits, shards, width)
            tokens.append(out.tokens)
            emitted.append(out.num_emitted)
            statuses.append(out.status)
            order.extend(group)
        # The one device-to-host read of the round.
        host_tokens, host_emitted, host_status = (torch.cat(t).tolist() for t in (tokens, emitted, statuses))
        results: list[RowResult] = [RowResult((), DeviceStatus.OK)] * len(sampling)
        for position, k in enumerate(order):
            n = host_emitted[position]
            results[k] = RowResult(tuple(host_tokens[position][:n]), DeviceStatus(host_status[position]))

        if self.fallback_on_invalid_speculation:
            retry = [k for k, r in enumerate(results) if r.status == DeviceStatus.INVALID_SPECULATION]
            if retry:
                for k, result in zip(retry, self._fall_back([original[sampling[k]] for k in retry], [offsets[k] for k in retry], logits)):
                    results[k] = result
        return results

    def _fall_back(self, rows: list[PlannedRow], offsets: list[int], logits: torch.Tensor) -> list[RowResult]:
        """Resample rows that got INVALID_SPECULATION without drafts, with the standard sampler
        (which supports filters), from the logits at each row's first position: the prediction
        after the last accepted token, which the rejected drafts never influenced."""
        plain = [dataclasses.replace(row, draft_ids=(), draft_probs=None, vocabulary_parallel=False, fault=None) for row in rows]
        first_logits = logits[torch.tensor(offsets, device=logits.device)]
        out = self._sample_rows(plain, first_logits, 1, 1)
        host_tokens, host_emitted, host_status = out.tokens.tolist(), out.num_emitted.tolist(), out.status.tolist()
        return [
            RowResult(tuple(t[:n]), DeviceStatus(s), fell_back=True) for t, n, s in zip(host_tokens, host_emitted, host_status)
        ]

    def _sample_rows(self, rows: list[PlannedRow], logits: torch.Tensor, shards: int, width: int):
        k_max = width - 1
        draft_tokens = torch.full((len(rows), max(k_max, 1)), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            if row.draft_ids:
                draft_tokens[r, : len(row.draft_ids)] = torch.tensor(row.draft_ids)
        draft_probs = None
        if any(row.draft_probs is not None for row in rows):
            draft_probs = torch.zeros(len(rows), max(k_max, 1), self.vocab_size)
            for r, row in enumerate(rows):
                if row.draft_probs is not None:
                    draft_probs[r, : len(row.draft_ids)] = row.draft_probs
                else:
                    for j, token in enumerate(row.draft_ids):
                        if 0 <= token < self.vocab_size:
                            draft_probs[r, j, token] = 1.0
        batch = SamplingBatch.from_rows(
            [row.params for row in rows],
            seeds=[row.seed for row in rows],
            positions=[row.output_position for row in rows],
            prompt_ids=[row.prompt_ids for row in rows],
            output_ids=[row.output_ids for row in rows],
            device=logits.device,
        )
        return sample_round(
            logits,
            num_drafts=torch.tensor([len(row.draft_ids) for row in rows], dtype=torch.long, device=logits.device),
            draft_tokens=draft_tokens.to(logits.device),
            draft_probs=None if draft_probs is None else draft_probs.to(logits.device),
            batch=batch,
            vocab_shards=shards,
        )

    def _embeddable(self, token_ids: tuple[int, ...]) -> tuple[int, ...]:
        v = self.vocab_size
        return token_ids if all(0 <= t < v for t in token_ids) else tuple(t if 0 <= t < v else 0 for t in token_ids)

    def _with_fault(self, row: PlannedRow) -> PlannedRow:
        """Fault injection (tests only): make the row's real device path produce the status.

        NONFINITE_LOGITS writes NaN into the row's logits after the forward, EMPTY_DISTRIBUTION
        writes the float32 floor there and samples at temperature 0.5 (scaling overflows to
        -inf everywhere); the others change what the kernels receive: an out-of-vocabulary
        draft, a draft probability of 0, a negative temperature, a filter under the
        vocabulary-parallel sampler.
        """
        fault = row.fault
        if fault is None or not row.samples:
            return row
        if fault == DeviceStatus.INVALID_DRAFT_TOKEN:
            drafts = (self.vocab_size + 7,) + row.draft_ids[1:]
            tail = row.token_ids[: len(row.token_ids) - len(row.draft_ids)]
            return dataclasses.replace(row, draft_ids=drafts, token_ids=tail + drafts)
        if fault == DeviceStatus.INVALID_DRAFT_PROBABILITY:
            probs = torch.zeros(len(row.draft_ids), self.vocab_size)
            for j, token in enumerate(row.draft_ids[1:], start=1):
                probs[j, token] = 1.0  # q(x) = 0 for the first draft: outside (0, 1]
            return dataclasses.replace(row, draft_probs=probs)
        if fault == DeviceStatus.INVALID_SAMPLING_PARAMETERS:
            return dataclasses.replace(row, params=dataclasses.replace(row.params, temperature=-1.0))
        if fault == DeviceStatus.EMPTY_DISTRIBUTION:
            # Finite logits at the float32 floor (written after the forward) that temperature
            # scaling pushes to -inf: no token keeps a positive probability.
            return dataclasses.replace(row, params=dataclasses.replace(row.params, temperature=0.5))
        if fault == DeviceStatus.INVALID_SPECULATION:
            # Top-k 1 at temperature 1 (a sampled, filtered row) under the sharded sampler.
            filtered = dataclasses.replace(row.params, temperature=1.0, top_k=1)
            return dataclasses.replace(row, params=filtered, vocabulary_parallel=True)
        return row

    def _inject_logit_faults(self, rows: list[PlannedRow], sampling: list[int], logits: torch.Tensor) -> None:
        offsets = _logit_offsets([rows[i] for i in sampling])
        for k, i in enumerate(sampling):
            if rows[i].fault == DeviceStatus.NONFINITE_LOGITS:
                logits[offsets[k], 0] = float("nan")
            elif rows[i].fault == DeviceStatus.EMPTY_DISTRIBUTION:
                logits[offsets[k] : offsets[k] + rows[i].num_logits] = torch.finfo(logits.dtype).min


def _logit_offsets(rows: list[PlannedRow]) -> list[int]:
    offsets, total = [], 0
    for row in rows:
        offsets.append(total)
        total += row.num_logits
    return offsets
