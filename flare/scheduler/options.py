"""What an operator chooses for a scheduler (`flare run`'s options), beside what the package says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flare.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class SchedulerOptions:
    max_concurrency: int | None = None  # None: the package's serving.max_concurrency
    max_waiting: int = 256
    max_waiting_tokens: int = 262_144
    kv_cache_memory: int | None = None  # bytes; None: default_kv_cache_bytes
    kv_cache_dtype: str = "float32"  # manifest.KV_CACHE_DTYPES: what the KV cache stores
    prefix_cache: bool = True  # keep full KV blocks after their request for later prompts to share
    block_size: int = 16
    max_batched_tokens: int = 256  # tokens fed per round: decode rows' last tokens, then prompt chunks
    # Of those, what the oldest prompt still prefilling keeps each round while shorter prompts
    # go first (prefill_budget.py); at max_batched_tokens the oldest takes every round it can.
    oldest_prefill_share: int = 64
    draft_tokens: int | None = None  # None: the package's serving.draft_tokens; may only lower it
    # ngram, mtp (the package's learned draft head) or auto (mtp where the package ships a head,
    # else ngram); None: the package's serving.drafter.
    drafter: str | None = None
    # adaptive: each row's draft is cut to what its measured round costs say pays
    # (speculation/draft_length.py); fixed: every decode row verifies all the drafter proposes.
    draft_length: Literal["adaptive", "fixed"] = "adaptive"
    vocabulary_shards: int = 1
    tensor_parallel: int = 1  # ranks of one model (flare/parallel/): rank 0 here, the others spawned
    # Several hosts: how many, and where rank 0's rendezvous listens (this host is node 0).
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    tensor_parallel_cpus: str | None = None  # this host's ranks' CPU lists, "0-15|16-31" (parallel/threads.py)
    collective_timeout_s: float = 60.0  # a collective inside a round fails the group past this

    def parallel_layout(self) -> ParallelLayout:
        return ParallelLayout(self.tensor_parallel, self.nnodes, 0, self.master_addr, self.master_port)
    sampling_policy: Literal["package", "unfiltered"] = "package"
    on_invalid_speculation: Literal["fallback", "fail"] = "fallback"
    fault_injection: bool = False
    jump_forward: bool = True  # propose the tokens a grammar forces as drafts (free: always accepted)
    device: str = "cpu"
    weight_format: str = "auto"  # precision.FORMAT_CHOICES: what the linear layers multiply in
    activations: str = "auto"  # manifest.ACTIVATION_CHOICES: what ggml block weights multiply (quantized.served_activations)
    idle_tick_s: float = 1.0  # how often an idle loop wakes to send its heartbeat
