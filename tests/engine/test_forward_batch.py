"""Building a ragged forward batch: flat layout, slots, logit positions and the attention plan."""

from __future__ import annotations

import pytest
import torch

from flare.engine.batch import SHORT_ROW_MAX_TOKENS, ForwardBatch, ForwardRow

BLOCK = 4


def test_mixed_rows_put_short_rows_first_and_logits_in_row_order() -> None:
    long_tokens = list(range(100, 100 + SHORT_ROW_MAX_TOKENS + 4))
    rows = [
        ForwardRow(long_tokens, 8, [7, 3, 9, 1, 6, 2, 8], num_logits=1),  # long prompt chunk at 8..27
        ForwardRow([5], 6, [4, 0], num_logits=1),  # decode row at position 6
        ForwardRow([11, 12, 13], 2, [5, 10], num_logits=3),  # verify row at 2..4, crossing a block
    ]
    batch = ForwardBatch.build(rows, BLOCK)

    # Flat: decode row, verify row, then the long chunk.
    assert batch.token_ids.tolist() == [5, 11, 12, 13, *long_tokens]
    assert batch.positions.tolist() == [6, 2, 3, 4, *range(8, 28)]
    # Slot = block * 4 + offset.
    assert batch.slot_mapping[:4].tolist() == [0 * 4 + 2, 5 * 4 + 2, 5 * 4 + 3, 10 * 4 + 0]
    assert batch.slot_mapping[4].item() == 9 * 4 + 0  # position 8 is block index 2
    # Logits in row order: the long chunk's last token, the decode row, the three verify tokens.
    assert batch.logit_indices.tolist() == [4 + 19, 0, 1, 2, 3]
    assert batch.num_tokens == 24 and batch.num_logits == 5
    assert batch.max_position == 27

    short = batch.short_rows
    assert short is not None
    assert (short.num_rows, short.query_len, short.num_tokens) == (2, 3, 4)
    # The decode row is padded by repeating its one token; the output keeps only real slots.
    assert short.query_index.tolist() == [[0, 0, 0], [1, 2, 3]]
    assert short.output_index.tolist() == [0, 3, 4, 5]
    assert short.block_table.tolist() == [[4, 0], [5, 10]]
    assert short.mask.shape == (2, 1, 3, 8)
    assert short.mask[0, 0, 0].tolist() == [True] * 7 + [False]
    assert short.mask[1, 0].sum(-1).tolist() == [3, 4, 5]

    (chunk,) = batch.chunks
    assert (chunk.start, chunk.end) == (4, 24)
    assert chunk.block_table.tolist() == [7, 3, 9, 1, 6, 2, 8]
    assert chunk.mask.shape == (1, 1, 20, 28)
    assert chunk.mask[0, 0, 0].sum().item() == 9  # position 8 sees 0..8
    assert chunk.mask[0, 0, -1].sum().item() == 28


def test_rows_of_equal_length_need_no_padding_indices() -> None:
    rows = [ForwardRow([i], 10 + i, [i, i + 1, i + 2, i + 3], num_logits=1) for i in range(4)]
    batch = ForwardBatch.build(rows, BLOCK)
    assert batch.short_rows.query_index is None
    assert batch.short_rows.output_index is None
    assert batch.chunks == ()
    assert batch.logit_indices.tolist() == [0, 1, 2, 3]


def test_a_non_final_chunk_returns_no_logits() -> None:
    batch = ForwardBatch.build([ForwardRow(list(range(30)), 0, list(range(8)), num_logits=0)], BLOCK)
    assert batch.num_logits == 0
    assert batch.short_rows is None
    assert len(batch.chunks) == 1


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
    assert batch.short_rows.mask.dtype == torch.bool
