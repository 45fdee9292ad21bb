"""Prefix caching: full KV blocks kept after their request ends, found again by their tokens.

A full block is named by a hash chained through the blocks before it: the hash of block i
covers the namespace (what else makes KV differ: the package's weights, the KV dtype), the
hash of block i-1 and the block's own token ids. Equal hashes therefore mean equal tokens at
equal positions after an equal prefix, which is what makes two blocks' keys and values equal.
The hash is BLAKE2b (128 bits), so a collision, which would silently serve a wrong prefix, is
out of reach; Python's `hash()` of a tuple is not.

The cache is one more holder of each published block (`BlockAllocator.share`): while any
sequence also holds it, it is in use; when the cache is its only holder it is evictable, and
evictable blocks are reclaimed least recently used first, and only when the free list is
empty. So the cache never takes a block a request needs: to admission and preemption an
evictable block counts as free. A published block is never written again: a sequence that
must write into a block it does not own alone (a cached block, or its prompt's last block
shared with the other choices of its request) gets a private copy first (`owns` says when).

Nothing here touches the device: the scheduler has the copies made before the round's
forward pass (`KVCache.copy_blocks`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flare.engine.kv_cache import BlockAllocator, DoubleFree, OutOfBlocks

BlockHash = bytes
_DIGEST_BYTES = 16


def namespace_hash(*parts: str) -> BlockHash:
    """The root of every chain: what, besides the tokens, decides a block's keys and values."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=_DIGEST_BYTES).digest()


def scoped_root(root: BlockHash, scope: bytes) -> BlockHash:
    """The root of the chains of requests in `scope` (bytes derived from an API key and a
    request's cache_salt; empty: the shared scope, whose root is `root` itself). Blocks
    published under one scope are never found from another: every hash of the chain differs."""
    if not scope:
        return root
    return hashlib.blake2b(root + b"\x1fscope\x1f" + scope, digest_size=_DIGEST_BYTES).digest()


def chain_hashes(
    root: BlockHash, token_ids: Sequence[int], block_size: int, known: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """The hashes of every full block of `token_ids`: `known` (the hashes of its first blocks,
    computed before) followed by those of the blocks after them."""
    hashes = list(known)
    previous = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(previous, digest_size=_DIGEST_BYTES)
        digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in block))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


@dataclass(frozen=True)
class CacheCounts:
    cached: int  # blocks published in the cache, in use or not
    evictable: int  # cached blocks no sequence holds: kept, but reclaimed when blocks run out
    held: int  # blocks held by sequences (cached or not)
    free: int  # blocks holding nothing
    total: int


class PrefixCache:
    """The KV blocks of the running daemon: allocation, sharing, and the cache of full blocks.

    Every block a scheduler takes, shares or gives back goes through here, so the bookkeeping
    is one set of rules whether the cache is on or off; off, nothing is ever published or
    found, and it is the allocator alone.
    """

    def __init__(self, allocator: BlockAllocator, *, root: BlockHash, enabled: bool = True) -> None:
        self.allocator = allocator
        self.root = root
        self.enabled = enabled
        self._blocks: dict[BlockHash, int] = {}
        self._hashes: dict[int, BlockHash] = {}
        # Cached blocks whose only holder is the cache, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # ----------------------------------------------------------------- counts

    @property
    def num_available(self) -> int:
        """Blocks a request can get: the free ones and the evictable cached ones."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_held(self) -> int:
        """Blocks held by sequences."""
        return self.allocator.num_total - self.num_available

    def counts(self) -> CacheCounts:
        return CacheCounts(
            cached=len(self._hashes),
            evictable=len(self._evictable),
            held=self.num_held,
            free=self.allocator.num_free,
            total=self.allocator.num_total,
        )

    # ----------------------------------------------------------------- blocks for sequences

    def allocate(self, n: int) -> list[int]:
        """`n` new blocks, each held once by the caller, all or nothing. Evicts the least
        recently used cached blocks only for what the free list lacks; raises `OutOfBlocks`
        (changing nothing) when not even eviction gives enough."""
        if n > self.num_available:
            raise OutOfBlocks(n, self.num_available)
        while self.allocator.num_free < n:
            self._evict_one()
        return self.allocator.allocate(n)

    def share(self, blocks: Iterable[int]) -> None:
        """The caller holds `blocks` too (the choices of one request sharing their prompt)."""
        self.allocator.share(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        """The caller no longer holds `blocks` (a block table, in position order). A cached
        block whose last other holder this was stays cached and becomes evictable. The table's
        last blocks are marked least recently used: evicting a chain from its end keeps its
        beginning, which is what other requests can still share."""
        drops: dict[int, int] = {}
        for block in reversed(blocks):
            drops[block] = drops.get(block, 0) + 1
        for block, count in drops.items():
            if not 0 <= block < self.allocator.num_total:
                raise DoubleFree(f"block {block} is outside the pool of {self.allocator.num_total} blocks")
            # The cache's own reference is not the caller's to drop.
            held = self.allocator.references(block) - (block in self._hashes)
            if count > held:
                raise DoubleFree(f"block {block} is released more often than it is held (double free)")
        self.allocator.free(blocks)
        for block in drops:
            if block in self._hashes and self.allocator.references(block) == 1:
                self._evictable[block] = None

    def owns(self, block: int) -> bool:
        """Whether the caller may write into `block`: it is its only holder, and the block is
        not cached (a cached block's contents are what its hash says, for good). A block the
        caller shares must be copied into a block of its own first."""
        return self.allocator.references(block) == 1 and block not in self._hashes

    # ----------------------------------------------------------------- the cache

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes`, each now held by the caller too."""
        if not self.enabled:
            return []
        found = []
        for block_hash in hashes:
            block = self._blocks.get(block_hash)
            if block is None:
                break
            found.append(block)
        self.allocator.share(found)
        for block in found:
            self._evictable.pop(block, None)
        return found

    def publish(self, block: int, block_hash: BlockHash) -> bool:
        """Offer a full block of committed tokens, held by the caller, to the cache. False (and
        nothing changes) when the cache is off, already has these tokens in another block,
        or has this block."""
        if not self.enabled or block_hash in self._blocks or block in self._hashes:
            return False
        self.allocator.share([block])
        self._blocks[block_hash] = block
        self._hashes[block] = block_hash
        return True

    def clear(self) -> int:
        """Drop every cached block no sequence holds; returns how many. Blocks in use stay
        cached: dropping them would save nothing and cost their requests' successors a hit."""
        dropped = len(self._evictable)
        while self._evictable:
            self._evict_one()
        return dropped

    def _evict_one(self) -> None:
        block, _ = self._evictable.popitem(last=False)
        del self._blocks[self._hashes.pop(block)]
        self.allocator.free([block])
