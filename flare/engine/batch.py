"""One ragged batch of a forward round, and everything its layers need, computed once.

A round mixes rows of very different lengths: decode rows (1 new token), verify rows (1 + k
tokens) and prompt chunks (tens to thousands of tokens). Linear layers run on the flat token
dimension with no padding. Attention runs in a few calls per layer, each over an
`AttentionGroup` of rows with the same number of new tokens:

- short rows (at most `SHORT_ROW_MAX_TOKENS` new tokens) are grouped by their length, so a round
  of 32 decode rows costs one call per layer, and a round of decode rows plus verify rows of
  1 + k tokens costs two: nothing is padded in the query dimension (padding 31 decode rows to
  the length of one verify row costs more than the second call);
- each long prompt chunk gets a call of its own, so its length never multiplies another row.

Tokens are laid out flat group by group (short groups by length, then the long chunks), each
group's rows in row order, so every group reads one contiguous slice of the flat tokens as a
[rows, query_len] view. `logit_indices` maps back to row order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Decode rows carry 1 token and verify rows 1 + k with k <= 16; rows up to this length share a
# call with every row of the same length. A group's keys are padded to its longest context,
# which is cheap for a few queries per row but would multiply a long chunk's quadratic work,
# so longer rows (prompt chunks) get a call each.
SHORT_ROW_MAX_TOKENS = 17


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
class AttentionGroup:
    """Rows that share one attention call: `rows` rows of `query_len` new tokens each.

    Their tokens are the flat tokens `[start, end)`, row after row. `block_table`
    [rows, max_blocks] holds each row's blocks (of `block_size` slots) up to its last position,
    padded with block 0, which the mask hides. `start_positions` [rows] is the position of each
    row's first new token.
    """

    start: int
    rows: int
    query_len: int
    block_table: torch.Tensor
    start_positions: torch.Tensor
    block_size: int

    @property
    def end(self) -> int:
        return self.start + self.rows * self.query_len

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[rows, 1, query_len, max_blocks * block_size], True where a query may attend: keys of
        its own request at positions up to its own (causal). Built when first read: only the
        torch attention reads it, the C kernel's rounds never do."""
        device = self.start_positions.device
        positions = self.start_positions.view(-1, 1) + torch.arange(self.query_len, device=device)
        key_positions = torch.arange(self.block_table.shape[1] * self.block_size, device=device)
        return (key_positions <= positions.unsqueeze(-1)).unsqueeze(1)


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
    groups: tuple[AttentionGroup, ...]
    block_size: int
    max_position: int
    row_starts: tuple[int, ...] = ()  # flat index of each row's first token, in row order

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

        by_length: dict[int, list[int]] = {}
        long: list[list[int]] = []
        for i, row in enumerate(rows):
            if len(row.token_ids) <= SHORT_ROW_MAX_TOKENS:
                by_length.setdefault(len(row.token_ids), []).append(i)
            else:
                long.append([i])
        group_rows = [by_length[length] for length in sorted(by_length)] + long

        # Everything is built on the host as Python lists and moved to the device once per tensor.
        row_offset: dict[int, int] = {}
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        groups: list[AttentionGroup] = []
        for members in group_rows:
            groups.append(_attention_group([rows[i] for i in members], len(token_ids), block_size, device))
            for i in members:
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

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            token_ids=tensor(token_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            logit_indices=tensor(logit_indices),
            groups=tuple(groups),
            block_size=block_size,
            max_position=max(row.end_position for row in rows) - 1,
            row_starts=tuple(row_offset[i] for i in range(len(rows))),
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


def _attention_group(
    rows: list[ForwardRow], start: int, block_size: int, device: torch.device | str
) -> AttentionGroup:
    """The group of `rows` (all with the same number of new tokens) whose tokens begin at `start`."""
    used = [(row.end_position + block_size - 1) // block_size for row in rows]
    max_blocks = max(used)
    block_tables = [list(row.block_table[:n]) + [0] * (max_blocks - n) for row, n in zip(rows, used)]
    return AttentionGroup(
        start=start,
        rows=len(rows),
        query_len=len(rows[0].token_ids),
        block_table=torch.tensor(block_tables, dtype=torch.long, device=device),
        start_positions=torch.tensor([row.start_position for row in rows], dtype=torch.long, device=device),
        block_size=block_size,
    )
