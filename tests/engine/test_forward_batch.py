"""Building a ragged forward batch: flat layout, slots, logit positions and the attention plan."""

from __future__ import annotations

import pytest
import torch

from flare.engine.batch import SHORT_ROW_MAX_TOKENS, ForwardBatch, ForwardRow

BLOCK = 4


def test_rows_are_grouped_by_length_and_logits_come_back_in_row_order() -> None:
    long_tokens = list(range(100, 100 + SHORT_ROW_MAX_TOKENS + 3))  # 20 tokens
    rows = [
        ForwardRow(long_tokens, 8, [7, 3, 9, 1, 6, 2, 8], num_logits=1),  # long prompt chunk at 8..27
        ForwardRow([5], 6, [4, 0], num_logits=1),  # decode row at position 6
        ForwardRow([11, 12, 13], 2, [5, 10], num_logits=3),  # verify row at 2..4, crossing a block
        ForwardRow([21], 1, [11], num_logits=1),  # another decode row
    ]
    batch = ForwardBatch.build(rows, BLOCK)

    # Flat: the decode rows (length 1), the verify row (length 3), then the long chunk.
    assert batch.token_ids.tolist() == [5, 21, 11, 12, 13, *long_tokens]
    assert batch.positions.tolist() == [6, 1, 2, 3, 4, *range(8, 28)]
    # Slot = block * 4 + offset.
    assert batch.slot_mapping[:5].tolist() == [0 * 4 + 2, 11 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 10 * 4 + 0]
    assert batch.slot_mapping[5].item() == 9 * 4 + 0  # position 8 is block index 2
    # Logits in row order: the long chunk's last token, a decode row, the three verify tokens, a decode row.
    assert batch.logit_indices.tolist() == [5 + 19, 0, 2, 3, 4, 1]
    assert batch.num_tokens == 25 and batch.num_logits == 6
    assert batch.max_position == 27

    decode, verify, chunk = batch.groups
    assert (decode.start, decode.end, decode.rows, decode.query_len) == (0, 2, 2, 1)
    assert decode.block_table.tolist() == [[4, 0], [11, 0]]  # the second row padded with block 0
    assert decode.mask.shape == (2, 1, 1, 8)
    assert decode.mask[0, 0, 0].tolist() == [True] * 7 + [False]
    assert decode.mask[1, 0, 0].tolist() == [True] * 2 + [False] * 6

    assert (verify.start, verify.end, verify.rows, verify.query_len) == (2, 5, 1, 3)
    assert verify.block_table.tolist() == [[5, 10]]
    assert verify.mask[0, 0].sum(-1).tolist() == [3, 4, 5]

    assert (chunk.start, chunk.end, chunk.rows, chunk.query_len) == (5, 25, 1, 20)
    assert chunk.block_table.tolist() == [[7, 3, 9, 1, 6, 2, 8]]
    assert chunk.mask.shape == (1, 1, 20, 28)
    assert chunk.mask[0, 0, 0].sum().item() == 9  # position 8 sees 0..8
    assert chunk.mask[0, 0, -1].sum().item() == 28


def test_long_chunks_of_equal_length_get_a_call_each() -> None:
    n = SHORT_ROW_MAX_TOKENS + 1
    rows = [ForwardRow(list(range(n)), 0, list(range(8)), 1), ForwardRow(list(range(n)), 0, list(range(8, 16)), 1)]
    batch = ForwardBatch.build(rows, BLOCK)
    assert [(g.start, g.rows) for g in batch.groups] == [(0, 1), (n, 1)]


def test_a_non_final_chunk_returns_no_logits() -> None:
    batch = ForwardBatch.build([ForwardRow(list(range(30)), 0, list(range(8)), num_logits=0)], BLOCK)
    assert batch.num_logits == 0
    assert len(batch.groups) == 1


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (ForwardRow([], 0, [0], 0), "no tokens"),
        (ForwardRow([1], -1, [0], 1), "negative start_position"),
        (ForwardRow([1, 2], 0, [0], 3), "asks for 3 logits but has 2 tokens"),
        (ForwardRow([1, 2], 3, [0], 1), "needs 2 blocks of 4, but its block table has 1"),
    ],
)
def test_invalid_rows_are_refused_with_the_reason(row: ForwardRow, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ForwardBatch.build([row], BLOCK)


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        ForwardBatch.build([], BLOCK)


def test_tensors_land_on_the_requested_device() -> None:
    batch = ForwardBatch.build([ForwardRow([1, 2], 0, [0], 1)], BLOCK, device=torch.device("cpu"))
    assert batch.token_ids.device.type == "cpu"
    assert batch.groups[0].mask.dtype == torch.bool
