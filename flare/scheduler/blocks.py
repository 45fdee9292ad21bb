"""Each sequence's KV blocks, over the prefix cache (nano-vllm's block manager).

A sequence's `block_table` maps its positions to blocks of `block_size` slots. Blocks may be
shared: with the prefix cache (the leading `num_published` ones were offered to it) and with the
other choices of the request. A block a row will write must be its own: a shared one is copied
first, and the copies are returned to the caller, who puts them in the round's plan (the runner
makes them before the forward). Choosing what to preempt when the pool runs short is the
scheduler's; here a request for blocks either gets all of them or changes nothing.
"""

from __future__ import annotations

from flare.engine.kv_cache import OutOfBlocks, blocks_for_tokens
from flare.engine.prefix_cache import PrefixCache, chain_hashes, scoped_root
from flare.scheduler.sequence import Sequence

# One copy-on-write: (the shared block, the sequence's own copy of it).
BlockCopy = tuple[int, int]


class BlockManager:
    def __init__(self, cache: PrefixCache, block_size: int, *, head_slot: bool) -> None:
        """`head_slot`: a draft head runs, whose KV holds one slot more than the target's (the
        new token's, drafters/mtp.py), so a sequence keeps the block of that slot too."""
        self.cache = cache
        self.block_size = block_size
        self._head_slot = head_slot

    @property
    def capacity(self) -> int:
        """Positions the whole KV cache holds."""
        return self.cache.allocator.num_total * self.block_size

    def map_cached_prefix(self, seq: Sequence) -> None:
        """Map the longest run of cached blocks that continues `seq`'s table to the blocks that
        hold it: at admission, its cached prefix; while it prefills, the blocks of its prompt
        that another prompt computed meanwhile (a burst of prompts with one system prompt,
        admitted together before any of it was cached, computes it once rather than once each).
        At least the last token is computed again: the row that samples needs its logits."""
        if not self.cache.enabled or seq.request.prompt_logprobs is not None or not self._at_block_boundary(seq):
            # A scored prompt is computed whole: cached blocks hold no logits to score it by.
            return
        start = len(seq.block_table)
        seq.block_hashes = chain_hashes(self._root(seq), seq.tokens, self.block_size, seq.block_hashes)
        # A last block that holds the last token is found too, and copied before that token's
        # position is written again: cheaper than computing the whole block.
        found = self.cache.lookup(seq.block_hashes[start:])
        if found:
            seq.block_table.extend(found)
            seq.num_published = len(seq.block_table)
            seq.num_cached = min(len(seq.block_table) * self.block_size, len(seq.tokens) - 1)

    def followers(self, prefilling: list[Sequence]) -> set[Sequence]:
        """Of the prompts still prefilling, in arrival order, those that would compute next a
        block an earlier one is computing or about to compute (the same tokens after the same
        prefix): they wait, and take it from the cache once it is there (`map_cached_prefix`),
        rather than compute it again in the same round."""
        if not self.cache.enabled:
            return set()
        leaders: set[bytes] = set()
        followers: set[Sequence] = set()
        for seq in prefilling:
            if seq.request.prompt_logprobs is not None:
                continue  # computed whole, its block hashes known only as far as computed
            block = seq.num_cached // self.block_size
            if block >= len(seq.block_hashes):
                continue  # its next block is its prompt's last, partial one: nobody else's
            next_hash = seq.block_hashes[block]
            if self._at_block_boundary(seq) and next_hash in leaders:
                followers.add(seq)
            else:
                leaders.add(next_hash)
        return followers

    def _at_block_boundary(self, seq: Sequence) -> bool:
        """`seq` has computed exactly the blocks of its table and offered them all to the cache,
        so cached blocks can follow them; not so with a block partly computed (a prompt chunk
        that ended mid-block) or one not yet published."""
        return seq.num_cached == len(seq.block_table) * self.block_size and seq.num_published == len(seq.block_table)

    def _root(self, seq: Sequence) -> bytes:
        """The root of `seq`'s hash chain: its request's cache scope decides whose blocks it
        finds and who finds its blocks."""
        return scoped_root(self.cache.root, seq.request.cache_scope)

    def admission_need(self, seq: Sequence) -> int:
        """Blocks `seq` (mapped to its cached prefix) still needs to hold all its tokens and the
        next one, plus a block of its own for each choice still to fork off it."""
        return blocks_for_tokens(len(seq.tokens) + 1, self.block_size) - len(seq.block_table) + len(seq.pending_choices)

    def fork(self, leader: Sequence) -> None:
        """The other choices of `leader`'s request share its blocks of all but the prompt's last
        token (which each choice computes itself, to sample its own first token)."""
        prompt_len = leader.num_prompt_tokens
        shared = leader.block_table[: blocks_for_tokens(prompt_len - 1, self.block_size)]
        for choice in leader.pending_choices:
            self.cache.share(shared)
            choice.block_table = list(shared)
            choice.num_cached = prompt_len - 1
            choice.num_published = min(leader.num_published, len(shared))
            choice.block_hashes = leader.block_hashes[: prompt_len // self.block_size]

    def make_writable(self, seq: Sequence, num_positions: int) -> list[BlockCopy] | None:
        """Give `seq` blocks it may write for positions `num_cached .. num_positions - 1`: new
        ones past its table, and private copies of the blocks in that range it shares. Returns
        the copies to make before the round's forward, or None, changing nothing, when the pool
        is short."""
        shared = [
            i
            for i in range(seq.num_cached // self.block_size, len(seq.block_table))
            if i * self.block_size < num_positions and not self.cache.owns(seq.block_table[i])
        ]
        needed = blocks_for_tokens(num_positions, self.block_size) - len(seq.block_table) + len(shared)
        if needed <= 0:
            return []
        try:
            fresh = self.cache.allocate(needed)
        except OutOfBlocks:
            return None
        copies: list[BlockCopy] = []
        for i in shared:
            copy = fresh.pop()
            copies.append((seq.block_table[i], copy))
            self.cache.release([seq.block_table[i]])
            seq.block_table[i] = copy
            seq.num_published = min(seq.num_published, i)
        seq.block_table.extend(fresh)
        return copies

    def release(self, seq: Sequence) -> None:
        """Give back every block of `seq`; nothing of it is cached any more (the head's slots
        included)."""
        self.cache.release(seq.block_table)
        seq.block_table.clear()
        seq.num_cached = 0
        seq.head_cached = 0
        seq.num_published = 0

    def trim(self, seq: Sequence) -> None:
        """Release blocks past the cached positions (those of rejected drafts) at once."""
        keep = blocks_for_tokens(seq.num_cached + (1 if self._head_slot else 0), self.block_size)
        if len(seq.block_table) > keep:
            self.cache.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def publish(self, seq: Sequence) -> None:
        """Offer the prefix cache every block of `seq` that is now full of committed tokens:
        keys and values of positions that hold a prompt token or an accepted output token,
        never a draft's that may still be rejected."""
        if not self.cache.enabled:
            return
        committed = min(seq.num_cached, len(seq.tokens))
        full = min(committed // self.block_size, len(seq.block_table))
        if full <= seq.num_published:
            return
        if len(seq.block_hashes) < full:
            seq.block_hashes = chain_hashes(
                self._root(seq), seq.tokens[: full * self.block_size], self.block_size, seq.block_hashes
            )
        for i in range(seq.num_published, full):
            self.cache.publish(seq.block_table[i], seq.block_hashes[i])
        seq.num_published = full
