"""The prefix cache's bookkeeping: hash chains, references, eviction order, copy-on-write."""

from __future__ import annotations

import pytest
import torch

from flare.engine.kv_cache import BlockAllocator, DoubleFree, KVCache, OutOfBlocks
from flare.engine.prefix_cache import PrefixCache, chain_hashes, namespace_hash

B = 4
ROOT = namespace_hash("weights=abc", "kv=float32")


def cache(num_blocks: int = 8, *, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_blocks), root=ROOT, enabled=enabled)


def held_request(c: PrefixCache, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """A request that computed `tokens` and published its full blocks, still holding them."""
    hashes = chain_hashes(c.root, tokens, B)
    blocks = c.allocate(-(-len(tokens) // B))
    for block, block_hash in zip(blocks, hashes):
        c.publish(block, block_hash)
    return blocks, hashes


def test_a_block_hash_names_its_tokens_and_everything_before_them() -> None:
    base = chain_hashes(ROOT, list(range(12)), B)
    assert len(base) == 3  # full blocks only
    assert chain_hashes(ROOT, list(range(14)), B) == base
    changed_first = chain_hashes(ROOT, [99, *range(1, 12)], B)
    assert all(a != b for a, b in zip(base, changed_first))  # a change reaches every later block
    changed_last = chain_hashes(ROOT, [*range(11), 99], B)
    assert changed_last[:2] == base[:2] and changed_last[2] != base[2]
    assert chain_hashes(namespace_hash("weights=other", "kv=float32"), list(range(12)), B)[0] != base[0]
    assert chain_hashes(ROOT, list(range(12)), B, known=base[:1]) == base  # extends what is known


def test_a_finished_requests_blocks_stay_cached_and_the_next_request_finds_its_longest_prefix() -> None:
    c = cache()
    blocks, hashes = held_request(c, list(range(10)))  # two full blocks, one partial
    c.release(blocks)
    assert c.counts().cached == 2 and c.counts().evictable == 2 and c.counts().held == 0
    assert c.num_available == 8  # evictable blocks count as available
    longer = chain_hashes(ROOT, [*range(8), 50, 51, 52, 53], B)
    found = c.lookup(longer)
    assert found == blocks[:2]
    assert c.counts().evictable == 0 and c.counts().held == 2
    assert c.lookup(chain_hashes(ROOT, [7, *range(1, 8)], B)) == []


def test_eviction_happens_only_when_free_blocks_run_out_least_recently_used_first_from_a_chains_end() -> None:
    c = cache(6)
    old, old_hashes = held_request(c, list(range(8)))
    c.release(old)
    new, new_hashes = held_request(c, list(range(100, 108)))
    c.release(new)
    assert c.counts().evictable == 4 and c.allocator.num_free == 2
    c.allocate(2)  # the free blocks first
    assert c.counts().cached == 4
    c.allocate(1)  # then the least recently used: the end of the older chain
    assert c.lookup(old_hashes) == [old[0]]
    assert c.lookup(new_hashes) == new


def test_the_cache_never_refuses_what_an_empty_cache_would_give_and_a_refusal_changes_nothing() -> None:
    c = cache(4)
    blocks, _ = held_request(c, list(range(16)))
    c.release(blocks)
    assert len(c.allocate(4)) == 4  # every cached block reclaimed
    assert c.counts().cached == 0
    d = cache(4)
    held, _ = held_request(d, list(range(8)))
    with pytest.raises(OutOfBlocks):
        d.allocate(3)
    assert d.num_available == 2 and d.counts().cached == 2


def test_a_block_released_more_often_than_held_is_a_double_free_even_while_the_cache_holds_it() -> None:
    c = cache()
    blocks, _ = held_request(c, list(range(8)))
    c.release(blocks)
    with pytest.raises(DoubleFree):
        c.release(blocks[:1])  # only the cache holds it now
    assert c.counts().cached == 2
    with pytest.raises(DoubleFree):
        c.release([42])


def test_a_shared_or_cached_block_is_copied_before_it_is_written() -> None:
    c = cache()
    [private] = c.allocate(1)
    assert c.owns(private)
    c.share([private])  # another choice of the request holds it too
    assert not c.owns(private)
    c.release([private])
    assert c.owns(private)
    blocks, _ = held_request(c, list(range(4)))
    assert not c.owns(blocks[0])  # cached: its contents are what its hash says


def test_clear_drops_only_blocks_no_request_holds() -> None:
    c = cache()
    kept, _ = held_request(c, list(range(8)))
    dropped, _ = held_request(c, list(range(50, 58)))
    c.release(dropped)
    assert c.clear() == 2
    assert c.counts().cached == 2 and c.counts().evictable == 0 and c.allocator.num_free == 6
    c.release(kept)
    assert c.counts().evictable == 2


def test_with_the_cache_off_nothing_is_published_or_found() -> None:
    c = cache(enabled=False)
    blocks, hashes = held_request(c, list(range(8)))
    c.release(blocks)
    assert c.counts().cached == 0 and c.allocator.num_free == 8
    assert c.lookup(hashes) == []


def test_shared_blocks_return_to_the_free_list_with_their_last_holder() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.share(blocks)
    assert allocator.free(blocks) == [] and allocator.num_free == 2
    assert sorted(allocator.free(blocks)) == sorted(blocks) and allocator.num_free == 4
    with pytest.raises(DoubleFree):
        allocator.share(blocks)


def test_copy_blocks_copies_every_layers_keys_and_values_in_order() -> None:
    kv = KVCache(num_layers=2, num_blocks=4, block_size=B, num_kv_heads=2, head_dim=3)
    for pool in (*kv.keys, *kv.values):
        pool.copy_(torch.randn_like(pool))
    before = [pool.clone() for pool in (*kv.keys, *kv.values)]
    kv.copy_blocks([(1, 3), (0, 1)])  # block 1 is read before it is overwritten
    for pool, old in zip((*kv.keys, *kv.values), before):
        assert torch.equal(pool[:, 3], old[:, 1]) and torch.equal(pool[:, 1], old[:, 0])
        assert torch.equal(pool[:, 0], old[:, 0]) and torch.equal(pool[:, 2], old[:, 2])
