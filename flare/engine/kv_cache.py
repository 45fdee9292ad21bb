"""The paged KV cache: fixed-size blocks in per-layer pools, handed out by a free-list allocator.

A request holds a block table (the ids of the blocks its positions live in, in order); position
p of that request lives in block `table[p // block_size]` at offset `p % block_size`. Blocks are
interchangeable, so a request holds only the blocks it uses and fragmentation cannot happen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from flare.preparation.manifest import ModelConfig

DEFAULT_BLOCK_SIZE = 16
# On a 24 GiB machine the fp32 weights of a small model take well under 1 GiB; 2 GiB of KV
# leaves room for activations, the tokenizer, the daemon and other processes. For the default
# model (30 layers, 3 KV heads of 64) that is about 46k cached tokens.
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than were asked for; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} KV cache blocks but only {free} are free")
        self.requested = requested
        self.free = free


class DoubleFree(ValueError):
    """A block was freed that is not currently allocated (freed twice, or never handed out)."""


class BlockAllocator:
    """A free list of block ids `0 .. num_blocks-1`."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self._num_total = num_blocks
        # A stack: the most recently freed block is reused first, which keeps the working set
        # of pool memory small when the server is lightly loaded.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._allocated = [False] * num_blocks

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, all or nothing; raises `OutOfBlocks` when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self._allocated[block] = True
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the free list; rejects (before changing anything) a block not held."""
        blocks = list(blocks)
        seen: set[int] = set()
        for block in blocks:
            if not 0 <= block < self._num_total:
                raise DoubleFree(f"block {block} is outside the pool of {self._num_total} blocks")
            if not self._allocated[block] or block in seen:
                raise DoubleFree(f"block {block} is not allocated (double free)")
            seen.add(block)
        for block in blocks:
            self._allocated[block] = False
            self._free.append(block)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def default_kv_cache_bytes(
    config: ModelConfig,
    *,
    max_context: int,
    max_concurrency: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> int:
    """The default budget: 2 GiB, or less when max_concurrency full contexts need less."""
    most_ever_used = (
        max_concurrency * blocks_for_tokens(max_context, block_size) * bytes_per_block(config, block_size, dtype)
    )
    return min(DEFAULT_KV_CACHE_BYTES, most_ever_used)


class KVCache:
    """Per-layer key and value pools `[num_kv_heads, num_blocks, block_size, head_dim]`.

    Head-major, so that the keys of one KV head in a block table's blocks gather into one
    contiguous [positions, head_dim] matrix, the layout attention reads fastest.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        # Zeroed, not empty: masked attention multiplies stale slots by a zero weight, and a NaN
        # bit pattern left in uninitialised memory would survive that multiplication.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_budget(
        cls,
        config: ModelConfig,
        budget_bytes: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """As many blocks as fit in `budget_bytes`; raises ValueError when not even one fits."""
        per_block = bytes_per_block(config, block_size, dtype)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"a KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                f"({per_block} bytes each); raise the budget (--kv-cache-memory) to at least {per_block}"
            )
        return cls(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def num_tokens(self) -> int:
        """How many token positions the pool holds in all."""
        return self.num_blocks * self.block_size
