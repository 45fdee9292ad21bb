"""Self-distillation of a draft head on the frozen target (`flare export --drafter mtp`).

1. Generate: the target answers the shipped prompt set (`prompts.py`) through flare's own
   scheduler (batched, seeded), the answers sampled at several temperatures.
2. Features, recorded during generation (`FeatureRecorder`, the runner's round observer, so no
   second pass of the target): its residual stream after the last layer at every position it
   computed (the head's input) and its next-token distribution where it sampled (the soft
   labels over the answer, kept as the top `LABEL_TOP_K` logits).
3. Train: the head, unrolled for K steps on its own hidden states (`head_model.py`), minimises
   the cross-entropy of its q against the target's p at every step (KL(p || q) up to p's
   entropy), over random windows of the training conversations, with Adam.
4. Measure: on the held-out conversations, the share of positions where the first j draft
   steps all equal the target's argmax, and from it the expected tokens per round at K.

Deterministic under a seed while the token budget, not the time budget, ends the training.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import TextIO

import anyio
import torch
import torch.nn.functional as F

from flare.distill.head_model import DraftHeadModule
from flare.distill.prompts import PROMPT_SET_NAME, distill_prompts, prompt_set_digest
from flare.engine.batch import ForwardBatch
from flare.engine.precision import cpu_has_native_bf16
from flare.engine.tokenizer import Tokenizer
from flare.package.draft_head import (
    FINAL_NORM_TENSOR,
    VOCAB_TENSOR,
    DraftHeadInfo,
    HeldOutAcceptance,
    head_parameter_count,
)
from flare.preparation.export import ExportError
from flare.preparation.source import ImportedDraftHead
from flare.package.directory import Package
from flare.policy.params import SamplingParams
from flare.scheduler.request import GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions

LABEL_TOP_K = 32
TEMPERATURES = (0.0, 0.7, 1.0)


@dataclass(frozen=True)
class DistillOptions:
    draft_tokens: int = 4  # K, the unrolled steps
    # Training positions (each window position of each step counts once). The head's acceptance
    # grows with them (docs/speculative.md); this many fit the time bound on a 2-core CPU, so
    # the tokens, not the clock, end the run there and it is reproducible.
    tokens: int = 4_800_000
    seconds: float = 1140.0  # wall-clock bound of the whole distillation (generation included): 19 minutes
    seed: int = 0
    dtype: str = "bfloat16"  # what the head is stored in
    draft_vocab_size: int = 8192
    answer_tokens: int = 192  # max_tokens of each generated answer
    window: int = 128  # tokens per training window
    batch: int = 8  # windows per step
    learning_rate: float = 2e-3
    prompt_limit: int | None = None  # use only the first N prompts (tests)


@dataclass
class Conversation:
    """One prompt and the target's answer, with the target's features at each position p:
    `hidden[p]` (bfloat16, zeros where not computed), and where `labelled[p]`, the top-k logits
    of its distribution of x_{p+1}."""

    tokens: list[int]
    prompt_len: int
    held_out: bool
    temperature: float = 0.0
    hidden: torch.Tensor | None = None  # [capacity, H]
    top_ids: torch.Tensor | None = None  # [capacity, LABEL_TOP_K]
    top_logits: torch.Tensor | None = None
    labelled: torch.Tensor | None = None  # [capacity] bool
    computed: int = 0  # positions 0 .. computed - 1 have their hidden state

    def allocate(self, capacity: int, hidden_size: int) -> None:
        self.hidden = torch.zeros(capacity, hidden_size, dtype=torch.bfloat16)
        self.top_ids = torch.zeros(capacity, LABEL_TOP_K, dtype=torch.long)
        self.top_logits = torch.zeros(capacity, LABEL_TOP_K, dtype=torch.float16)
        self.labelled = torch.zeros(capacity, dtype=torch.bool)

    def trim(self) -> None:
        """Keep the tokens up to one past the last computed position: slot p of the head reads
        the hidden state of p - 1, so the token after it is the last one the head can use."""
        del self.tokens[self.computed + 1 :]


class FeatureRecorder:
    """The runner's round observer during generation: copies each row's hidden states and, for a
    row that samples, the top-k of its logits into the row's conversation. Runs in the model
    thread; the conversations are read only after generation ends."""

    def __init__(self) -> None:
        self.by_request: dict[str, Conversation] = {}

    def __call__(self, plan, batch: ForwardBatch, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        offset = 0
        picks, targets = [], []
        for row, start in zip(plan.rows, batch.row_starts):
            c = self.by_request.get(row.request_id)
            n = len(row.token_ids)
            if c is not None and c.hidden is not None:
                end = min(row.start_position + n, c.hidden.shape[0])
                c.hidden[row.start_position : end] = hidden[start : start + end - row.start_position]
                c.computed = max(c.computed, end)
            if row.samples:
                offset += row.num_logits
                if c is not None and row.start_position + n - 1 < c.hidden.shape[0]:
                    picks.append(offset - 1)
                    targets.append((c, row.start_position + n - 1))
        if picks:
            top = logits[torch.tensor(picks, device=logits.device)].topk(LABEL_TOP_K, dim=-1)
            ids, values = top.indices.cpu(), top.values.to(torch.float16).cpu()
            for i, (c, position) in enumerate(targets):
                c.top_ids[position], c.top_logits[position], c.labelled[position] = ids[i], values[i], True


class Progress:
    """One status line for a person at a terminal; nothing when stderr is not one."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()

    def line(self, text: str, *, final: bool = False) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[2K  " + text + ("\n" if final else ""))
            self.stream.flush()


def distill_head(
    package: Package, options: DistillOptions, *, stderr: TextIO | None = None
) -> tuple[DraftHeadInfo, dict[str, torch.Tensor]]:
    """Distill a head for `package` (a package without one); returns its manifest entry and tensors."""
    started = time.monotonic()
    # The time budget: generation may take 40% of it (the answers cut there are dropped, a seeded
    # random subset of the prompts), training runs until 5% before the end (measuring on the
    # held-out answers and writing the package take the rest).
    generation_deadline = started + 0.4 * options.seconds
    deadline = started + 0.95 * options.seconds
    progress = Progress(stderr)
    torch.manual_seed(options.seed)
    prompts = distill_prompts()[: options.prompt_limit]
    conversations = _answers(package, prompts, options, progress, generation_deadline)
    generated = sum(len(c.tokens) - c.prompt_len for c in conversations)
    train = [c for c in conversations if not c.held_out]
    if not train:
        # The held-out answers are generated first: a budget that ends inside them leaves
        # nothing to train on.
        raise ExportError(
            f"the distillation's {options.seconds:g} s budget left {0.4 * options.seconds:.0f} s to generate the "
            f"target's answers, and no training answer was generated in it ({generated} tokens of held-out "
            "answers); give --distill-seconds a larger budget (the default is "
            f"{DistillOptions.seconds:g} s)",
            option="--distill-seconds",
        )
    draft_vocab = _draft_vocab(conversations, package.manifest.model.vocab_size, options.draft_vocab_size)
    state = package.load_state_dict()
    config = package.manifest.model
    embed = state["model.embed_tokens.weight"].float()
    lm = embed if config.tie_word_embeddings else state["lm_head.weight"].float()
    head = DraftHeadModule(
        config, draft_vocab, embed, lm[draft_vocab].contiguous(), state["model.norm.weight"].float(), seed=options.seed
    )
    del state
    held = [c for c in conversations if c.held_out and c.temperature == 0] or train[:1]
    positions, train_seconds = _train(head, train, held, options, progress, deadline)
    acceptance = measure_acceptance(head, held, options.draft_tokens)
    progress.line(
        f"draft head: {positions} positions trained, held-out {acceptance.tokens_per_round:.2f} tokens/round "
        f"at K={options.draft_tokens} ({time.monotonic() - started:.0f} s)",
        final=True,
    )
    info = DraftHeadInfo(
        draft_tokens=options.draft_tokens,
        draft_vocab_size=int(draft_vocab.numel()),
        parameters=head_parameter_count(config, int(draft_vocab.numel())),
        dtype=options.dtype,
        prompt_set=f"{PROMPT_SET_NAME} ({len(prompts)} conversations, {sum(p.held_out for p in prompts)} held out, sha256 {prompt_set_digest()})",
        budget={"tokens": options.tokens, "seconds": options.seconds, "seed": options.seed},
        trained={
            "generated_tokens": generated,
            "positions": positions,
            "train_seconds": round(train_seconds, 1),
            "seconds": round(time.monotonic() - started, 1),
            "temperatures": list(TEMPERATURES),
        },
        held_out=acceptance,
    )
    return info, head.state_for_package()


def imported_head(
    package: Package, imported: ImportedDraftHead, options: DistillOptions, *, stderr: TextIO | None = None
) -> tuple[DraftHeadInfo, dict[str, torch.Tensor]]:
    """A checkpoint's own MTP layer as the head of `package`: kept as it is (its decoder layer a
    Llama layer or the target's own kind, `imported.layer`), scoring the whole vocabulary and
    reading the target's hidden state after its final norm (the convention such layers are
    trained and served with), and measured on the held-out prompts like a distilled head. No
    training: `options` gives K, the stored dtype and the time bound of the measurement."""
    started = time.monotonic()
    progress = Progress(stderr)
    config = package.manifest.model
    prompts = [p for p in distill_prompts()[: options.prompt_limit] if p.held_out]
    held = _answers(package, prompts, options, progress, started + options.seconds)  # greedy: held-out prompts
    vocab = torch.arange(config.vocab_size)
    tensors = {**imported.tensors, VOCAB_TENSOR: vocab}
    own_norm = FINAL_NORM_TENSOR in tensors
    state = package.load_state_dict()
    embed = state["model.embed_tokens.weight"].float()
    lm = embed if config.tie_word_embeddings else state["lm_head.weight"].float()
    target_norm = state["model.norm.weight"].float()
    head = DraftHeadModule(
        config,
        vocab,
        embed,
        lm,
        tensors[FINAL_NORM_TENSOR] if own_norm else target_norm,
        seed=options.seed,
        target_norm=target_norm,
        layer=imported.layer,
    )
    del state
    head.load_package_state(tensors)
    with torch.no_grad():
        acceptance = measure_acceptance(head, held, options.draft_tokens)
    progress.line(
        f"draft head: imported, held-out {acceptance.tokens_per_round:.2f} tokens/round at K={options.draft_tokens}",
        final=True,
    )
    info = DraftHeadInfo(
        draft_tokens=options.draft_tokens,
        draft_vocab_size=config.vocab_size,
        parameters=head_parameter_count(config, config.vocab_size, own_final_norm=own_norm, layer=imported.layer),
        dtype=options.dtype,
        prompt_set=f"{PROMPT_SET_NAME} held-out conversations only ({len(prompts)}, sha256 {prompt_set_digest()}): measured, not trained",
        budget={"seconds": options.seconds},
        trained={
            "generated_tokens": sum(len(c.tokens) - c.prompt_len for c in held),
            "seconds": round(time.monotonic() - started, 1),
        },
        held_out=acceptance,
        target_hidden="final_norm",
        imported_from=imported.origin,
        layer=imported.layer,
    )
    return info, tensors


def _answers(
    package: Package, prompts: list, options: DistillOptions, progress: Progress, deadline: float
) -> list[Conversation]:
    """The target's answers to `prompts` with their features (`generate_answers`), through a scheduler
    of its own."""
    tokenizer = Tokenizer.from_package(package)
    # Every answer is queued at once: the queue bounds are the prompt set's size.
    queue = max(1, len(prompts) * len(TEMPERATURES))
    recorder = FeatureRecorder()
    scheduler = Scheduler.from_package(
        package,
        # No prefix cache: the recorder needs every position computed, the answers to one prompt
        # at other temperatures included.
        SchedulerOptions(draft_tokens=0, prefix_cache=False, max_waiting=queue, max_waiting_tokens=queue * 4096),
        round_observer=recorder,
    )
    return generate_answers(scheduler, tokenizer, prompts, options, progress, deadline, recorder)


def generate_answers(
    scheduler: Scheduler,
    tokenizer: Tokenizer,
    prompts: list,
    options: DistillOptions,
    progress: Progress,
    deadline: float,
    recorder: FeatureRecorder,
) -> list[Conversation]:
    """The target's answers to every prompt (temperatures in turn, seeded), batched by the
    scheduler, with their features (`recorder`, the scheduler's round observer)."""
    hidden_size = scheduler.target_model.config.hidden_size
    conversations: list[Conversation] = []
    requests = []
    for index, prompt in enumerate(prompts):
        ids = tuple(tokenizer.encode_chat(list(prompt.messages)))
        for temperature in TEMPERATURES:
            # Held-out prompts are answered greedily only: that is what their acceptance measures.
            if prompt.held_out and temperature > 0:
                continue
            params = SamplingParams(
                temperature=temperature,
                max_tokens=options.answer_tokens,
                seed=options.seed * 100_003 + index * len(TEMPERATURES) + TEMPERATURES.index(temperature),
            )
            request = GenerationRequest(f"distill-{len(requests)}-{secrets.token_hex(3)}", ids, params)
            conversation = Conversation(list(ids), len(ids), prompt.held_out, temperature)
            conversation.allocate(len(ids) + options.answer_tokens, hidden_size)
            recorder.by_request[request.request_id] = conversation
            requests.append(request)
            conversations.append(conversation)
    # The held-out answers first (acceptance is measured on them), the rest in a seeded random
    # order, so that answers a time budget cuts off are a random subset, not the last prompts.
    generator = torch.Generator().manual_seed(options.seed)
    held = [i for i, c in enumerate(conversations) if c.held_out]
    rest = [i for i, c in enumerate(conversations) if not c.held_out]
    order = held + [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
    requests = [requests[i] for i in order]
    conversations = [conversations[i] for i in order]
    budget = len(requests) * options.answer_tokens
    unfinished = len(requests)

    async def consume(stream, conversation: Conversation) -> None:
        nonlocal unfinished
        async for event in stream:
            if isinstance(event, TextDelta):
                conversation.tokens.extend(event.token_ids)
        unfinished -= 1

    async def watch() -> None:
        while unfinished:
            total = sum(len(c.tokens) - c.prompt_len for c in conversations)
            progress.line(f"generating: {total}/{budget} tokens")
            if time.monotonic() > deadline:  # out of time: what was generated is kept
                for request in requests:
                    scheduler.cancel(request.request_id)
                return
            await anyio.sleep(0.5)

    async def run() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(scheduler.run)
            async with anyio.create_task_group() as requests_group:
                for request, conversation in zip(requests, conversations):
                    requests_group.start_soon(consume, scheduler.submit(request), conversation)
                requests_group.start_soon(watch)
            scheduler.stop()

    asyncio.run(run())
    for c in conversations:
        c.trim()
    return [c for c in conversations if len(c.tokens) > c.prompt_len + 1]


def _draft_vocab(conversations: list[Conversation], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` ids the target emits or ranks first most often (ties by id), sorted."""
    counts: Counter[int] = Counter()
    for c in conversations:
        counts.update(c.tokens[c.prompt_len :])
        assert c.top_ids is not None and c.labelled is not None
        counts.update(c.top_ids[c.labelled, 0].tolist())
    size = min(size, vocab_size)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:  # too little text: fill with the lowest other ids
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def _labels(head: DraftHeadModule, c: Conversation, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's p over the top-k ids that are in the draft vocabulary, as (index into the
    draft vocabulary or 0, probability or 0) [T, LABEL_TOP_K]."""
    assert c.top_ids is not None and c.top_logits is not None and c.labelled is not None
    ids = c.top_ids[start:end]
    p = torch.softmax(c.top_logits[start:end].float(), -1) * c.labelled[start:end].unsqueeze(1)
    position = torch.searchsorted(head.draft_vocab, ids).clamp(max=head.draft_vocab.numel() - 1)
    inside = head.draft_vocab[position] == ids
    return position * inside, p * inside


def _windows(conversations: list[Conversation], options: DistillOptions, generator: torch.Generator) -> list[tuple[Conversation, int, int]]:
    batch = []
    for _ in range(options.batch):
        c = conversations[int(torch.randint(len(conversations), (1,), generator=generator))]
        n = len(c.tokens)
        # Windows end inside the answer: that is where the head drafts.
        last_start = max(0, n - options.window)
        low = min(last_start, max(0, c.prompt_len - options.window // 2))
        start = int(torch.randint(low, last_start + 1, (1,), generator=generator))
        batch.append((c, start, min(n, start + options.window)))
    return batch


def _loss(head: DraftHeadModule, windows: list[tuple[Conversation, int, int]], steps: int) -> tuple[torch.Tensor, int]:
    length = max(end - start for _, start, end in windows)
    hidden = torch.zeros(len(windows), length, head.config.hidden_size)
    tokens = torch.zeros(len(windows), length, dtype=torch.long)
    label_ids = torch.zeros(len(windows), length, LABEL_TOP_K, dtype=torch.long)
    label_p = torch.zeros(len(windows), length, LABEL_TOP_K)
    for b, (c, start, end) in enumerate(windows):
        assert c.hidden is not None
        n = end - start
        # The window's first slot reads the hidden state before it (zeros at position 0): shift
        # by hand, since `unrolled` shifts within the window.
        tokens[b, :n] = torch.tensor(c.tokens[start:end])
        rows = c.hidden[start : min(end, c.computed)]
        hidden[b, : rows.shape[0]] = rows.float()
        label_ids[b, :n], label_p[b, :n] = _labels(head, c, start, end)
    outputs = head.unrolled(hidden, tokens, steps)
    total = torch.zeros(())
    count = labelled = 0
    for step, g in enumerate(outputs):
        # Slot p of step j is valid from p = j - 1 on (its chain starts inside the window), and
        # slot 0 of a window that does not start the conversation reads zeros, not h_{start-1}:
        # it is left out too. Positions without a label (the prompt's) weigh nothing.
        logq = F.log_softmax(head.logits(g[:, step + 1 :]).float(), -1)
        p = label_p[:, step + 1 :]
        ce = -(p * logq.gather(-1, label_ids[:, step + 1 :])).sum(-1)
        total = total + ce.sum() / (1.0 + 0.5 * step)
        count += ce.numel()
        labelled += int((p.sum(-1) > 0).sum())
    return total / max(1, labelled), count


def _train(
    head: DraftHeadModule,
    train: list[Conversation],
    held: list[Conversation],
    options: DistillOptions,
    progress: Progress,
    deadline: float,
) -> tuple[int, float]:
    started = time.monotonic()
    generator = torch.Generator().manual_seed(options.seed)
    optimizer = torch.optim.AdamW(head.weights, lr=options.learning_rate, weight_decay=0.0)
    per_step = options.batch * options.window * options.draft_tokens
    total_steps = max(1, math.ceil(options.tokens / per_step))
    positions = 0
    held_rate = float("nan")
    autocast = cpu_has_native_bf16()
    for step in range(total_steps):
        if time.monotonic() > deadline:
            break
        # Warm-up, then cosine decay over the token budget (by step, so a run is reproducible).
        lr = options.learning_rate * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        # bfloat16 GEMMs where the CPU has them natively, which train faster than float32; the
        # weights and the optimizer stay float32.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, count = _loss(head, _windows(train, options, generator), options.draft_tokens)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.weights, 1.0)
        optimizer.step()
        positions += count
        if step % 50 == 49:
            held_rate = measure_acceptance(head, held[:8], options.draft_tokens).tokens_per_round
        progress.line(
            f"training: {positions}/{options.tokens} positions, loss {loss.item():.3f}, held-out {held_rate:.2f} tokens/round"
        )
    return positions, time.monotonic() - started


@torch.no_grad()
def measure_acceptance(head: DraftHeadModule, conversations: list[Conversation], steps: int) -> HeldOutAcceptance:
    """Greedy chain acceptance over the answers of `conversations` (greedy answers: each token
    is the target's argmax, so feeding the true token is feeding what a greedy draft proposed)."""
    hits = [0] * steps
    total = 0
    for c in conversations:
        assert c.hidden is not None and c.top_ids is not None and c.labelled is not None
        tokens = torch.tensor(c.tokens).unsqueeze(0)
        outputs = head.unrolled(c.hidden[: tokens.shape[1]].float().unsqueeze(0), tokens, steps)
        target = c.top_ids[:, 0]  # the target's argmax at each position
        # Chain starting at slot q (the head's slot of a new token): step j at slot q + j - 1
        # must equal the target's argmax at that position, and the token it is fed at the next
        # step is the true one, which for a greedy answer is that argmax too.
        first, last = max(c.prompt_len, 1), len(c.tokens) - steps
        if last <= first:
            continue
        chain = torch.ones(last - first, dtype=torch.bool)
        for j, g in enumerate(outputs):
            guess = head.draft_vocab[head.logits(g[0, first + j : last + j]).argmax(-1)]
            chain &= (guess == target[first + j : last + j]) & c.labelled[first + j : last + j]
            # Teacher forcing holds only where the next true token is the argmax.
            if j + 1 < steps:
                chain &= tokens[0, first + j + 1 : last + j + 1] == target[first + j : last + j]
            hits[j] += int(chain.sum())
        total += last - first
    per_step = tuple(h / max(1, total) for h in hits)
    return HeldOutAcceptance(per_step=per_step, tokens_per_round=1.0 + sum(per_step), positions=total)


