"""Building a scheduler's parts from a package and the operator's options: the served policy,
the weights, the KV cache and its prefix cache, the draft head, the runner, the drafter, the
tokenizer and the grammar compiler. Heavy: called off the event loop."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import structlog
import torch

from flare.engine import native_quantized
from flare.engine.drafters import Drafter, make_drafter
from flare.engine.drafters.mtp import load_draft_head
from flare.engine.kv_cache import BlockAllocator, KVCache, default_kv_cache_bytes
from flare.engine.model import load_model
from flare.engine.quantized import served_activations
from flare.engine.precision import cpu_flags, dtype_name
from flare.engine.prefix_cache import PrefixCache, namespace_hash
from flare.engine.tokenizer import Tokenizer
from flare.package.blocks import kernelless_tensors
from flare.parallel.serving import RankDriver, split_for
from flare.parallel.tensor_split import check_tensor_parallel, rank_config
from flare.package.contract import check_contract
from flare.package.directory import Package
from flare.policy.policy import PolicyError, SamplingPolicy
from flare.scheduler.errors import ContractViolation
from flare.scheduler.round.model_runner import ModelRunner, RoundObserver
from flare.scheduler.round.model_thread import ModelThread
from flare.scheduler.options import SchedulerOptions
from flare.structured import GrammarCompiler
from flare.structured.memory import give_back_heap

log = structlog.get_logger("flare.scheduler")


def resolve_drafter(package: Package, requested: str | None) -> str:
    """The drafter to run: `requested` (ngram, mtp, auto) or the package's serving.drafter.
    mtp for a package without a draft head raises ValueError naming the fix."""
    name = requested or package.manifest.serving.drafter
    has_head = package.manifest.draft_head is not None
    if name == "auto":
        # The head, with n-gram lookup beside it (`DraftPlanner.proposal`); n-gram alone without one.
        return "mtp" if has_head else "ngram"
    if name == "mtp" and not has_head:
        raise ValueError(
            f"--drafter mtp: the package at {package.path} ships no draft head; re-export it with "
            "`flare export SOURCE -o DIR --drafter mtp` to distill one, or run with --drafter ngram"
        )
    if name not in ("ngram", "mtp"):
        raise ValueError(f"--drafter must be one of ngram, mtp, auto, got {name!r}")
    return name


def served_policy(package: Package, mode: Literal["package", "unfiltered"]) -> SamplingPolicy:
    """The policy requests are clamped to: the package's own, after the same sampler contract
    check that export runs, or `unfiltered()` of it (`flare run --sampling-policy unfiltered`)."""
    policy = package.manifest.sampling
    if mode == "unfiltered":
        try:
            return policy.unfiltered()
        except PolicyError as error:
            raise ContractViolation(f"--sampling-policy unfiltered cannot serve {package.path}: {error}") from error
    problems = check_contract(package.manifest.serving, policy, str(package.path))
    if problems:
        raise ContractViolation(f"refusing to serve {package.path}: " + " ".join(p.message for p in problems))
    return policy


@dataclass(frozen=True)
class SchedulerParts:
    """Everything a `Scheduler` runs with, loaded and sized."""

    package: Package
    policy: SamplingPolicy
    tokenizer: Tokenizer
    runner: ModelRunner
    cache: PrefixCache
    drafter: Drafter | None  # n-gram lookup, alone or beside the head; None: no lookup
    drafter_name: str  # ngram, mtp, auto, or none without speculation
    max_concurrency: int
    draft_tokens: int
    model_thread: ModelThread
    owns_model_thread: bool  # the scheduler ends the thread when its loop ends
    grammars: GrammarCompiler


def load_parts(
    package: Package,
    options: SchedulerOptions,
    *,
    drafter: Drafter | None = None,
    round_observer: RoundObserver | None = None,
    model_thread: ModelThread | None = None,
) -> SchedulerParts:
    """Load the package's weights and size the KV cache (`Scheduler.from_package` says what the
    arguments mean). The sampler contract is checked before any weight is read."""
    serving = package.manifest.serving
    policy = served_policy(package, options.sampling_policy)
    max_concurrency = min(options.max_concurrency or serving.max_concurrency, serving.max_concurrency)
    draft_tokens = serving.draft_tokens if options.draft_tokens is None else options.draft_tokens
    if draft_tokens > serving.draft_tokens:
        raise ValueError(
            f"--draft-tokens {draft_tokens} is more than the package's {serving.draft_tokens} "
            f"(serving.draft_tokens); it may only lower it: re-export with --mtp-draft-tokens to raise it"
        )
    drafter_name = resolve_drafter(package, options.drafter)
    auto = (options.drafter or serving.drafter) == "auto"
    device = torch.device(options.device)
    config = package.manifest.model

    # What the blocks multiply, resolved once from what was asked (auto by default) and the
    # package's block types; the workers resolve it alike from the same package.
    activations = served_activations(package.weight_types(), options.activations)
    tensor_parallel = options.tensor_parallel
    if tensor_parallel > 1:
        check_tensor_parallel(config, tensor_parallel)
        if device.type != "cpu" or round_observer is not None:
            raise ValueError("--tensor-parallel runs on the CPU, and not while distilling a draft head")

    def load() -> ModelRunner:
        kv_dtype = getattr(torch, options.kv_cache_dtype)
        # Each rank's pool holds its share of the KV heads; the budget is each rank's.
        rank_model_config = rank_config(config, tensor_parallel)
        budget = options.kv_cache_memory or default_kv_cache_bytes(
            rank_model_config,
            max_context=serving.max_context,
            max_concurrency=max_concurrency,
            block_size=options.block_size,
            dtype=kv_dtype,
        )
        kv_cache = KVCache.for_budget(rank_model_config, budget, block_size=options.block_size, dtype=kv_dtype, device=device)
        ranks = None
        if tensor_parallel > 1:
            # The workers load their shards while this process loads rank 0's.
            ranks = RankDriver(
                str(package.path),
                options.parallel_layout(),
                weight_format=options.weight_format,
                activations=options.activations,
                collective_timeout=timedelta(seconds=options.collective_timeout_s),
                bind=options.tensor_parallel_cpus,
            )
        try:
            split = split_for(0, tensor_parallel) if ranks is not None else None
            model = load_model(package, device=device, weight_format=options.weight_format, split=split, activations=activations)
            if ranks is not None:
                ranks.connect(config.vocab_size, kv_cache)
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise
        log.info(
            "engine_loaded",
            device=str(device),
            threads=torch.get_num_threads(),
            native_kernels=model.native_kernels,
            weights_dtype=serving.dtype,
            weight_format=str(model.weight_format),
            weight_types=package.weight_types(),
            activations=activations,
            integer_level=native_quantized.integer_level_name() if activations != "float32" and model.native_kernels else "none",
            layer_calls=model.layer_calls,
            cpu_flags=" ".join(cpu_flags()),
            kv_cache_blocks=kv_cache.num_blocks,
            kv_cache_dtype=dtype_name(kv_cache.dtype),
            block_size=kv_cache.block_size,
            prefix_cache=options.prefix_cache,
            drafter=drafter_name if draft_tokens > 0 else "none",
            draft_tokens=draft_tokens,
            draft_length=options.draft_length,
            tensor_parallel=tensor_parallel,
        )
        # Tensors without a kernel are served as float32, at four times their bytes in the file and
        # float32's speed (docs/packages.md, "From GGUF").
        as_floats = list(kernelless_tensors(package.manifest.dequantized, package.manifest.blocks).values())
        if as_floats:
            log.warning(
                "weights_dequantized",
                tensors=len(as_floats),
                types=" ".join(sorted(set(as_floats))),
                message="tensors of a type flare has no kernel for are served as float32; flare export --quantize q8_0 "
                "(or q4_k_m) of the source stores them as blocks",
            )
        head = None
        if drafter_name == "mtp" and draft_tokens > 0:
            head = load_draft_head(
                package, model, num_blocks=kv_cache.num_blocks, block_size=kv_cache.block_size, kv_dtype=kv_cache.dtype
            )
        return ModelRunner(
            model,
            kv_cache,
            vocab_size=config.vocab_size,
            vocabulary_shards=options.vocabulary_shards,
            fallback_on_invalid_speculation=options.on_invalid_speculation == "fallback",
            device=device,
            head=head,
            observer=round_observer,
            ranks=ranks,
        )

    # The weights load on the thread that will run the rounds (round/model_thread.py says why).
    owns_model_thread = model_thread is None
    model_thread = model_thread or ModelThread()
    try:
        runner = model_thread.run(load)
    except BaseException:
        if owns_model_thread:
            model_thread.shutdown()
        raise
    model, kv_cache, head = runner.model, runner.kv_cache, runner.head
    # Whatever besides the tokens decides a block's keys and values: the weights (by their
    # checksums) and the dtypes the model computes and stores them in.
    root = namespace_hash(
        *(f"{name}={digest}" for name, digest in sorted(package.manifest.files.items())),
        f"kv={dtype_name(kv_cache.dtype)}",
        f"weights={model.weight_format}",
        f"native={model.native_kernels}",
    )
    named = "auto" if auto and head is not None else drafter_name
    parts = SchedulerParts(
        package=package,
        policy=policy,
        tokenizer=Tokenizer.from_package(package),
        runner=runner,
        cache=PrefixCache(BlockAllocator(kv_cache.num_blocks), root=root, enabled=options.prefix_cache),
        # n-gram lookup runs alone, or beside the head under `auto` (rows whose text repeats).
        drafter=(drafter or make_drafter("ngram")) if draft_tokens > 0 and (head is None or auto) else None,
        drafter_name=named if draft_tokens > 0 else "none",
        max_concurrency=max_concurrency,
        draft_tokens=draft_tokens,
        model_thread=model_thread,
        owns_model_thread=owns_model_thread,
        grammars=GrammarCompiler(
            package.tokenizer_json_path.read_text(encoding="utf-8"),
            vocab_size=config.vocab_size,
            eos_token_ids=config.eos_token_ids,
        ),
    )
    # What the load freed stays resident in glibc's arenas unless handed back: the tokenizers'
    # parse of a 150k-token tokenizer.json alone leaves about 75 MB of free chunks, and the
    # loading threads' arenas are reused, never shrunk, by the threads that serve. Measured on a
    # Qwen3-MoE package: 93 MiB less resident after the load.
    give_back_heap()
    return parts
