"""Preemption: while a running sequence's next blocks do not fit, the newest running sequence
gives its blocks back and waits again at the head of the queue (nano-vllm's
`while not can_append(seq): preempt(...)`). It is recomputed from its tokens later, from its
cached prefix if the prefix cache kept it, with the same output: sampling is seeded by position.
"""

from __future__ import annotations

from collections import deque

import structlog

from flare.scheduler.blocks import BlockCopy, BlockManager
from flare.scheduler.sequence import Sequence, SequenceState

log = structlog.get_logger("flare.scheduler")


def make_writable(
    seq: Sequence, num_positions: int, *, blocks: BlockManager, running: list[Sequence], waiting: deque[Sequence]
) -> list[BlockCopy] | None:
    """Blocks `seq` may write for positions `num_cached .. num_positions - 1`, and the copies to
    make for them before the round's forward, preempting the newest running sequences while the
    pool is short. None when that preempted `seq` itself, or when `seq`, running alone, is still
    short: it has outgrown the whole cache (it is left running, for the scheduler to end)."""
    while (copies := blocks.make_writable(seq, num_positions)) is None:
        victim = max(running, key=lambda s: (s.arrival, s.index))
        if victim is seq and len(running) == 1:
            return None
        preempt(victim, blocks=blocks, running=running, waiting=waiting)
        if victim is seq:
            return None
    return copies


def preempt(seq: Sequence, *, blocks: BlockManager, running: list[Sequence], waiting: deque[Sequence]) -> None:
    """Free a running sequence's blocks and put it back at the head of the queue."""
    blocks.release(seq)
    seq.preemptions += 1
    seq.state = SequenceState.WAITING
    running.remove(seq)
    waiting.appendleft(seq)
    log.info("request_preempted", request_id=seq.request_id, tokens=len(seq.tokens), preemptions=seq.preemptions)
