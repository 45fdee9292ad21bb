"""The block allocator and the sizing of the KV cache pools."""

from __future__ import annotations

import pytest
import torch
from tests.engine.tiny_llama import tiny_config

from flare.engine.kv_cache import (
    DEFAULT_KV_CACHE_BYTES,
    BlockAllocator,
    DoubleFree,
    KVCache,
    OutOfBlocks,
    bytes_per_block,
    default_kv_cache_bytes,
)


def test_allocated_blocks_are_distinct_and_leave_the_free_list() -> None:
    allocator = BlockAllocator(10)
    first = allocator.allocate(4)
    second = allocator.allocate(3)
    assert len(set(first) | set(second)) == 7
    assert all(0 <= b < 10 for b in first + second)
    assert allocator.num_free == 3
    assert allocator.num_total == 10


def test_exhaustion_allocates_nothing_and_says_how_many_are_free() -> None:
    allocator = BlockAllocator(5)
    allocator.allocate(3)
    with pytest.raises(OutOfBlocks) as error:
        allocator.allocate(3)
    assert (error.value.requested, error.value.free) == (3, 2)
    assert allocator.num_free == 2
    assert len(allocator.allocate(2)) == 2


def test_every_block_returns_to_the_free_list() -> None:
    allocator = BlockAllocator(8)
    held = [allocator.allocate(3), allocator.allocate(5)]
    assert allocator.num_free == 0
    for blocks in held:
        allocator.free(blocks)
    assert allocator.num_free == 8
    assert sorted(allocator.allocate(8)) == list(range(8))


def test_double_free_is_rejected_and_changes_nothing() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.free(blocks[:1])
    with pytest.raises(DoubleFree):
        allocator.free(blocks)  # blocks[0] again, blocks[1] for the first time
    assert allocator.num_free == 3
    with pytest.raises(DoubleFree):
        allocator.free([blocks[1], blocks[1]])
    with pytest.raises(DoubleFree):
        allocator.free([99])
    allocator.free([blocks[1]])
    assert allocator.num_free == 4


def test_cache_sized_by_budget_holds_as_many_blocks_as_fit() -> None:
    config = tiny_config()
    per_block = bytes_per_block(config, 16, torch.float32)
    assert per_block == 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 4
    cache = KVCache.for_budget(config, 10 * per_block + per_block - 1, block_size=16)
    assert cache.num_blocks == 10
    assert len(cache.keys) == len(cache.values) == config.num_layers
    assert cache.keys[0].shape == (config.num_kv_heads, 10, 16, config.head_dim)
    assert cache.num_tokens == 160


def test_a_budget_too_small_for_one_block_names_the_option() -> None:
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        KVCache.for_budget(tiny_config(), 100)


def test_default_budget_is_two_gib_unless_the_context_needs_less() -> None:
    config = tiny_config()
    small = default_kv_cache_bytes(config, max_context=100, max_concurrency=2, block_size=16)
    assert small == 2 * 7 * bytes_per_block(config, 16, torch.float32)
    big = default_kv_cache_bytes(config, max_context=10**6, max_concurrency=1000)
    assert big == DEFAULT_KV_CACHE_BYTES


def _anonymous_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pools_start_zeroed_and_become_resident_only_as_blocks_are_written(dtype: torch.dtype) -> None:
    # 512 MiB of float32 pools (256 MiB of bfloat16): a daemon's KV budget must not be resident
    # memory before its blocks fill.
    before = _anonymous_mib()
    cache = KVCache(num_layers=4, num_blocks=2048, block_size=16, num_kv_heads=8, head_dim=64, dtype=dtype)
    assert _anonymous_mib() - before < 16
    assert all(bool((pool == 0).all()) for pool in cache.keys + cache.values)
    written = _anonymous_mib()
    for pool in cache.keys + cache.values:
        pool[:, :256] = 1.0  # an eighth of every pool's blocks
    grown = _anonymous_mib() - written
    pool_mib = sum(p.numel() * p.element_size() for p in cache.keys + cache.values) / 2**20
    assert pool_mib / 8 * 0.9 < grown < pool_mib / 8 * 1.1 + 8
    assert bool((cache.keys[0][:, 256:] == 0).all()) and bool((cache.keys[0][:, :256] == 1).all())
