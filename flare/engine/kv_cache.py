"""The paged KV cache: fixed-size blocks in per-layer pools, handed out by a free-list allocator.

A request holds a block table (the ids of the blocks its positions live in, in order); position
p of that request lives in block `table[p // block_size]` at offset `p % block_size`. Blocks are
interchangeable, so a request holds only the blocks it uses and fragmentation cannot happen.
"""

from __future__ import annotations

import math
import mmap
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from flare.package.model_config import ModelConfig

DEFAULT_BLOCK_SIZE = 16
# On a 24 GiB machine the fp32 weights of a small model take well under 1 GiB; 2 GiB of KV
# leaves room for activations, the tokenizer, the daemon and other processes. For the default
# model (30 layers, 3 KV heads of 64) that is about 46k cached tokens.
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor for a KV pool. Zeroed, not empty: masked attention multiplies stale slots by
    a zero weight, and a NaN bit pattern left in uninitialised memory would survive that.

    On the CPU it is an anonymous mapping of its own, whose pages the kernel hands out zeroed on
    first write: the pool becomes resident as its blocks fill, not all at start (torch.zeros
    writes every byte, so a 2 GiB budget was 2 GiB of RSS before the first request)."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, count * torch.empty((), dtype=dtype).element_size(), flags=mmap.MAP_PRIVATE)
    # frombuffer holds a reference to the mapping: it lives as long as the tensor.
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than were asked for; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} KV cache blocks but only {free} are free")
        self.requested = requested
        self.free = free


class DoubleFree(ValueError):
    """A block was freed more often than it is held (freed twice, or never handed out)."""


class BlockAllocator:
    """Block ids `0 .. num_blocks-1`, each free or held by one or more holders.

    A block's reference count is its number of holders: sequences whose block tables name it
    (several when a prompt is shared by the choices of one request or by a cached prefix) and
    the prefix cache itself while the block is published there. `allocate` hands out blocks
    with one reference, `share` adds one, `free` drops one; a block returns to the free list
    when its last holder lets go.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self._num_total = num_blocks
        # A stack: the most recently freed block is reused first, which keeps the working set
        # of pool memory small when the server is lightly loaded.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._references = [0] * num_blocks

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    def references(self, block: int) -> int:
        """How many holders `block` has (0: it is free)."""
        return self._references[block]

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, all or nothing; raises `OutOfBlocks` when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self._references[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each of `blocks`, which must be held already."""
        blocks = list(blocks)
        for block in blocks:
            if not 0 <= block < self._num_total or self._references[block] == 0:
                raise DoubleFree(f"block {block} is not allocated, so it cannot be shared")
        for block in blocks:
            self._references[block] += 1

    def free(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference to each of `blocks` (a block named twice loses two); rejects,
        before changing anything, a block freed more often than it is held. Returns the
        blocks that went back to the free list."""
        drops = Counter(blocks)
        for block, count in drops.items():
            if not 0 <= block < self._num_total:
                raise DoubleFree(f"block {block} is outside the pool of {self._num_total} blocks")
            if count > self._references[block]:
                raise DoubleFree(f"block {block} is not allocated (double free)")
        released = []
        for block, count in drops.items():
            self._references[block] -= count
            if self._references[block] == 0:
                self._free.append(block)
                released.append(block)
        return released


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token takes in the cache across all layers, keys and values, in the model's
    layout (`ModelConfig.kv_layout`: latent attention keeps one latent row, not a key and a
    value per head)."""
    return config.kv_elements_per_token * torch.empty((), dtype=dtype).element_size()


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return block_size * bytes_per_token(config, dtype)


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
    contiguous [positions, head_dim] matrix, the layout attention reads fastest. The values may
    be narrower than the keys (`value_dim`): latent attention's pool is one "head" of
    [latent | rope key] rows with values of width 0, its values being the keys' latent prefix.
    Blocks, copy-on-write and everything above them are the same for every layout.
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
        value_dim: int | None = None,
    ) -> None:
        """`value_dim`: the values' width, `head_dim` unless given (0: no value pool)."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        value_shape = (num_kv_heads, num_blocks, block_size, head_dim if value_dim is None else value_dim)
        self.keys = [zeroed_pool(shape, dtype, device) for _ in range(num_layers)]
        self.values = [zeroed_pool(value_shape, dtype, device) for _ in range(num_layers)]

    @classmethod
    def for_config(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """`num_blocks` blocks in the model's layout (`ModelConfig.kv_layout`)."""
        layout = config.kv_layout
        return cls(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=layout.heads,
            head_dim=layout.key_dim,
            value_dim=layout.value_dim,
            dtype=dtype,
            device=device,
        )

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
        return cls.for_config(config, num_blocks, block_size, dtype, device)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy every layer's keys and values of block `source` into block `target`, for each
        (source, target) pair in order: the copy-on-write of a block shared with another holder."""
        if not pairs:
            return
        sources = torch.tensor([s for s, _ in pairs], device=self.keys[0].device)
        targets = torch.tensor([t for _, t in pairs], device=self.keys[0].device)
        # Pairs run in order, so a block freed by one copy and reused as another's target
        # is read before it is overwritten; index_copy_ would not promise that order.
        ordered = len(set(targets.tolist()) & set(sources.tolist())) > 0
        for pool in (*self.keys, *self.values):
            if ordered:
                for source, target in pairs:
                    pool[:, target] = pool[:, source]
            else:
                pool[:, targets] = pool[:, sources]

    @property
    def dtype(self) -> torch.dtype:
        """What the pools store keys and values as (the model computes in float32 on a CPU
        whatever they hold: 16-bit elements are widened when read)."""
        return self.keys[0].dtype

    @property
    def num_tokens(self) -> int:
        """How many token positions the pool holds in all."""
        return self.num_blocks * self.block_size
