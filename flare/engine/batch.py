"""One ragged batch of a forward round, and everything its layers need, computed once.

A round mixes rows of very different lengths: decode rows (1 new token), verify rows (1 + k
tokens) and prompt chunks (tens to thousands of tokens). Linear layers run on the flat token
dimension with no padding. Attention is split in two kinds of call:

- the short rows (at most `SHORT_ROW_MAX_TOKENS` new tokens) share ONE padded attention call, so a
  round of 32 decode rows costs one call per layer, not 32;
- each long prompt chunk gets its own call, so padding never multiplies a long chunk by the
  number of rows.

Tokens are laid out flat with the short rows first (in row order), then each long chunk, so each
kind of call reads a contiguous slice of the flat tokens. `logit_indices` maps back to row order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Verify rows carry 1 + k tokens with k <= 8; short prompt chunks up to this size also join the
# padded call, where padding them costs at most this many query slots per row.
SHORT_ROW_MAX_TOKENS = 16


@dataclass(frozen=True)
class ForwardRow:
    """New tokens at positions `start_position ...` of one request.

    Their keys and values go into the blocks of `block_table` (which must already cover every
    position up to the last new token), and attention sees every earlier position of the
    request. Logits are returned for the last `num_logits` tokens: 0 for a non-final prompt
    chunk, 1 for a prompt's last chunk or a decode row, 1 + k for a verify row with k drafts.
    """

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    num_logits: int

    @property
    def end_position(self) -> int:
        """One past the position of the last new token (the row's context length after it)."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class ShortRowsAttention:
    """The padded attention call of the short rows: `num_rows` rows of up to `query_len` tokens.

    The rows' tokens are the flat tokens `[0, num_tokens)`. `query_index` [num_rows, query_len]
    gathers them into the padded layout (pad slots repeat the row's last token, so no query has
    an empty mask); `output_index` [num_tokens] picks the real slots back out of the flattened
    padded output. Both are None when every row has `query_len` tokens (plain views suffice).
    `block_table` [num_rows, max_blocks] is padded with block 0, which the mask hides.
    `mask` [num_rows, 1, query_len, max_blocks * block_size] is True where a query may attend.
    """

    num_rows: int
    query_len: int
    num_tokens: int
    query_index: torch.Tensor | None
    output_index: torch.Tensor | None
    block_table: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class ChunkAttention:
    """The attention call of one long prompt chunk: flat tokens `[start, end)`.

    `block_table` [num_blocks] holds exactly the blocks up to the chunk's last position;
    `mask` [1, 1, end - start, num_blocks * block_size] is causal with the chunk's offset.
    """

    start: int
    end: int
    block_table: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    """Flat per-token tensors and the attention plan of one round (see the module docstring).

    `token_ids`, `positions` and `slot_mapping` (the pool slot `block * block_size + offset` each
    new token's key and value is written to) are [num_tokens] in flat order. `logit_indices`
    [num_logits] are the flat indices of the tokens whose logits are returned, in row order.
    `max_position` is the largest position, kept on the host so checking it costs no device read.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logit_indices: torch.Tensor
    short_rows: ShortRowsAttention | None
    chunks: tuple[ChunkAttention, ...]
    block_size: int
    max_position: int

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_logits(self) -> int:
        return self.logit_indices.shape[0]

    @classmethod
    def build(
        cls, rows: Sequence[ForwardRow], block_size: int, device: torch.device | str = "cpu"
    ) -> ForwardBatch:
        if not rows:
            raise ValueError("a forward batch needs at least one row")
        for i, row in enumerate(rows):
            _check_row(i, row, block_size)

        short = [i for i, row in enumerate(rows) if len(row.token_ids) <= SHORT_ROW_MAX_TOKENS]
        long = [i for i, row in enumerate(rows) if len(row.token_ids) > SHORT_ROW_MAX_TOKENS]

        # Flat layout: the short rows, then each long chunk. Everything is built on the host as
        # Python lists and moved to the device once per tensor.
        row_offset: dict[int, int] = {}
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for i in short + long:
            row = rows[i]
            row_offset[i] = len(token_ids)
            token_ids.extend(row.token_ids)
            for position in range(row.start_position, row.end_position):
                positions.append(position)
                slots.append(row.block_table[position // block_size] * block_size + position % block_size)

        logit_indices: list[int] = []
        for i, row in enumerate(rows):
            end = row_offset[i] + len(row.token_ids)
            logit_indices.extend(range(end - row.num_logits, end))

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            token_ids=tensor(token_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            logit_indices=tensor(logit_indices),
            short_rows=_short_rows_attention([rows[i] for i in short], block_size, device) if short else None,
            chunks=tuple(
                _chunk_attention(rows[i], row_offset[i], block_size, device) for i in long
            ),
            block_size=block_size,
            max_position=max(row.end_position for row in rows) - 1,
        )


def _check_row(index: int, row: ForwardRow, block_size: int) -> None:
    num_tokens = len(row.token_ids)
    if num_tokens == 0:
        raise ValueError(f"row {index} has no tokens")
    if row.start_position < 0:
        raise ValueError(f"row {index} has a negative start_position ({row.start_position})")
    if not 0 <= row.num_logits <= num_tokens:
        raise ValueError(f"row {index} asks for {row.num_logits} logits but has {num_tokens} tokens")
    needed = (row.end_position + block_size - 1) // block_size
    if len(row.block_table) < needed:
        raise ValueError(
            f"row {index} reaches position {row.end_position - 1}, which needs {needed} blocks of "
            f"{block_size}, but its block table has {len(row.block_table)}"
        )


def _short_rows_attention(
    rows: list[ForwardRow], block_size: int, device: torch.device | str
) -> ShortRowsAttention:
    lengths = [len(row.token_ids) for row in rows]
    query_len = max(lengths)
    num_tokens = sum(lengths)
    max_blocks = max((row.end_position + block_size - 1) // block_size for row in rows)

    query_index: list[list[int]] = []
    output_index: list[int] = []
    query_positions: list[list[int]] = []
    block_tables: list[list[int]] = []
    offset = 0
    for r, row in enumerate(rows):
        n = len(row.token_ids)
        pad = query_len - n
        query_index.append([offset + q for q in range(n)] + [offset + n - 1] * pad)
        output_index.extend(r * query_len + q for q in range(n))
        query_positions.append(list(range(row.start_position, row.end_position)) + [row.end_position - 1] * pad)
        used = (row.end_position + block_size - 1) // block_size
        block_tables.append(list(row.block_table[:used]) + [0] * (max_blocks - used))
        offset += n

    positions = torch.tensor(query_positions, dtype=torch.long, device=device)
    key_positions = torch.arange(max_blocks * block_size, device=device)
    # A query at position p attends to every key at position <= p of its own request (causal).
    mask = (key_positions <= positions.unsqueeze(-1)).unsqueeze(1)
    uniform = all(n == query_len for n in lengths)
    return ShortRowsAttention(
        num_rows=len(rows),
        query_len=query_len,
        num_tokens=num_tokens,
        query_index=None if uniform else torch.tensor(query_index, dtype=torch.long, device=device),
        output_index=None if uniform else torch.tensor(output_index, dtype=torch.long, device=device),
        block_table=torch.tensor(block_tables, dtype=torch.long, device=device),
        mask=mask,
    )


def _chunk_attention(
    row: ForwardRow, start: int, block_size: int, device: torch.device | str
) -> ChunkAttention:
    num_blocks = (row.end_position + block_size - 1) // block_size
    positions = torch.arange(row.start_position, row.end_position, device=device)
    key_positions = torch.arange(num_blocks * block_size, device=device)
    mask = (key_positions <= positions.unsqueeze(-1))[None, None]
    return ChunkAttention(
        start=start,
        end=start + len(row.token_ids),
        block_table=torch.tensor(list(row.block_table[:num_blocks]), dtype=torch.long, device=device),
        mask=mask,
    )
