"""Each sequence's blocks over the prefix cache (`BlockManager`): the `n` choices share a prompt's
blocks, a shared block is copied before it is written (the copies returned, for the round's
plan), a short pool changes nothing, and trimming keeps the draft head's slot."""

from __future__ import annotations

import asyncio

import torch

from flare.engine.kv_cache import BlockAllocator, bytes_per_block
from flare.engine.prefix_cache import PrefixCache, namespace_hash
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.blocks import BlockManager
from flare.scheduler.request import Finished, GenerationRequest, RequestStream
from flare.scheduler.scheduler import Scheduler, SchedulerOptions
from flare.scheduler.sequence import Sequence

B = 4


def manager(num_blocks: int, *, head_slot: bool = False) -> BlockManager:
    cache = PrefixCache(BlockAllocator(num_blocks), root=namespace_hash("test"), enabled=True)
    return BlockManager(cache, B, head_slot=head_slot)


def sequence(prompt: list[int], n: int = 1) -> Sequence:
    request = GenerationRequest("r", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=8), n=n)
    stream = RequestStream("r", choices=n)
    # The detokenizer and stop matcher are not what blocks read.
    choices = [
        Sequence(request=request, stream=stream, seed=i, detokenizer=None, stop_matcher=None, draft_state=None, index=i)  # type: ignore[arg-type]
        for i in range(n)
    ]
    choices[0].pending_choices = choices[1:]
    return choices[0]


def test_the_choices_share_the_prompt_and_each_copies_the_block_it_writes_first() -> None:
    blocks = manager(8)
    leader = sequence(list(range(10)), n=2)  # 10 tokens: blocks 0-2, the last one partly filled
    assert blocks.admission_need(leader) == 3 + 1  # its own 3, and a block for the other choice
    assert blocks.make_writable(leader, 9) == []  # fresh blocks: nothing to copy
    leader.num_cached = 9
    other = leader.pending_choices[0]
    blocks.fork(leader)
    assert other.block_table == leader.block_table and other.num_cached == 9
    # The other choice writes position 9, in the third block, which it shares: it gets a copy.
    shared = other.block_table[2]
    copies = blocks.make_writable(other, 10)
    assert copies == [(shared, other.block_table[2])] and other.block_table[2] != shared
    assert other.block_table[:2] == leader.block_table[:2]  # the full blocks stay shared
    assert blocks.cache.owns(other.block_table[2]) and blocks.cache.owns(shared)  # each its own now


def test_a_short_pool_gives_nothing_and_changes_nothing() -> None:
    blocks = manager(3)
    seq = sequence(list(range(6)))
    assert blocks.make_writable(seq, 6) == []
    before = (list(seq.block_table), blocks.cache.counts())
    assert blocks.make_writable(seq, 6 + 2 * B) is None  # two blocks more: the pool has one
    assert (seq.block_table, blocks.cache.counts()) == before


def test_trimming_releases_the_blocks_of_rejected_drafts_but_keeps_the_heads_slot() -> None:
    for head_slot, kept in ((False, 2), (True, 3)):
        blocks = manager(8, head_slot=head_slot)
        seq = sequence(list(range(8)))
        blocks.make_writable(seq, 16)  # the row's tokens and its drafts: 4 blocks
        seq.num_cached = 8  # the drafts were rejected
        blocks.trim(seq)
        assert len(seq.block_table) == kept  # the head's KV holds the new token's slot, 8
        blocks.release(seq)
        assert seq.block_table == [] and blocks.cache.counts().held == 0


async def test_a_lone_drafting_sequence_that_outgrows_the_cache_ends_and_gives_back_every_block(
    tiny_package, package_parts
) -> None:
    # Three blocks, one sequence at a time, n-gram drafts: each answer outgrows the pool and ends
    # "length"; the next request must find the whole pool free again.
    pool = 3 * bytes_per_block(package_parts["config"], 16, torch.float32)
    options = SchedulerOptions(max_concurrency=1, kv_cache_memory=pool, prefix_cache=False)
    scheduler = Scheduler.from_package(open_package(tiny_package), options)
    loop = asyncio.create_task(scheduler.run())
    try:
        for i in range(4):
            request = GenerationRequest(
                f"r{i}", tuple(range(5, 22)), SamplingParams(temperature=0.0, max_tokens=500)
            )
            events = [event async for event in scheduler.submit(request)]
            assert isinstance(events[-1], Finished) and events[-1].reason == "length"
            assert events[-1].usage.completion_tokens > 0
            assert scheduler.snapshot().kv_blocks_used == 0
    finally:
        scheduler.stop()
        await loop
